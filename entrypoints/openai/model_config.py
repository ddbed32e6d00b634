"""Which engines a server runs: one model, `--data-parallel-size N` replicas of it, or the several models
of `--models FILE` (docs/serving.md, "Several models"). The YAML file:

    models:
      - name: smol                      # the name clients send as `model`
        model: /models/smol.gguf        # or `path:`; neither: the default model (SmolLM2-135M-Instruct)
        kv_cache_share: 2               # of the server's --kv-cache-memory (or kv_cache_memory: 512MiB)
        data_parallel_size: 1
        max_num_seqs: 32                # any engine option, as the CLI's flag in snake_case
        lora_modules: {sql: /adapters/sql}
      - name: tiny
        path: /models/tiny-llama
        device: cpu

Engine options not given in the file are the command line's. Memory and CPU threads are split between
the engines: `kv_cache_memory` per model, or the server's `--kv-cache-memory` (and, on a shared GPU,
`--gpu-memory-utilization`) divided by `kv_cache_share`; `num_threads` defaults to cores / engines.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any, Optional, Union

from tokenmill.core.config import parse_size

from ..engine_args import ENGINE_ARG_NAMES
from .engine_client import EngineClient
from .replica_set import ReplicaSet

logger = logging.getLogger("tokenmill.serve")

# Keys a model entry may have besides the engine options (ENGINE_ARG_NAMES).
ROUTER_KEYS = ("name", "path", "kv_cache_share", "data_parallel_size", "adapters")
SETTINGS_KEYS = ("served_model_name", "chat_template", "tool_call_parser", "reasoning_parser",
                 "enable_auto_tool_choice")
LORA_KEYS = ("enable_lora", "lora_modules", "max_loras", "max_lora_rank")     # passed to the engine as given
_NOT_PER_MODEL = ("tensor_parallel_size",)      # the parallelism flags are the command line's

Engines = Union[EngineClient, ReplicaSet]


class ModelEntryError(ValueError):
    """A model entry (YAML, or a /v1/models/load body) is wrong: `key` names the field, `unknown` when the
    field is not one a model entry may have."""

    def __init__(self, message: str, key: Optional[str] = None, unknown: bool = False) -> None:
        super().__init__(message)
        self.key, self.unknown = key, unknown


def allowed_keys() -> tuple[str, ...]:
    engine = tuple(k for k in ENGINE_ARG_NAMES if k not in _NOT_PER_MODEL)
    return tuple(dict.fromkeys(ROUTER_KEYS + engine + SETTINGS_KEYS + LORA_KEYS))


@dataclass
class ModelSpec:
    """One served model: its engine kwargs, replicas, and the serving settings it overrides."""
    name: str
    engine_kwargs: dict[str, Any]
    data_parallel_size: int = 1
    kv_cache_share: float = 1.0
    settings: dict[str, Any] = field(default_factory=dict)     # ServerSettings fields for this model
    explicit: frozenset = frozenset()                          # the keys the entry itself gave


def spec_from_entry(entry: Any, base_kwargs: dict[str, Any], where: str) -> ModelSpec:
    """A ModelSpec from one YAML entry (or a /v1/models/load body): ValueError naming the key and model."""
    if not isinstance(entry, dict):
        raise ModelEntryError(f"{where}: each model must be a mapping with at least `name` and `model`, got {entry!r}")
    name = entry.get("name")
    if not isinstance(name, str) or not name.strip():
        raise ModelEntryError(f"{where}: a model has no `name` (the name clients send as `model`)", "name")
    where = f"{where}: model {name!r}"
    known = allowed_keys()
    for key in entry:
        if key not in known:
            raise ModelEntryError(f"{where}: unknown key {key!r} (known keys: {', '.join(sorted(known))})", str(key),
                                  unknown=True)
    if "model" in entry and "path" in entry:
        raise ModelEntryError(f"{where}: give the checkpoint as one of `model` or `path`, not both", "model")
    path = entry.get("model", entry.get("path"))     # neither: the default model, as `serve` without MODEL
    if path is not None and (not isinstance(path, str) or not path):
        raise ModelEntryError(f"{where}: `model` must be a file or directory path, got {path!r}", "model")
    kwargs = {k: v for k, v in base_kwargs.items() if k not in ("served_model_name",)}
    kwargs.update({k: v for k, v in entry.items() if k not in ROUTER_KEYS + SETTINGS_KEYS})
    kwargs["model"] = path
    kwargs["served_model_name"] = name
    if "adapters" in entry and "lora_modules" in entry:
        raise ModelEntryError(f"{where}: give the LoRA adapters as `adapters` or `lora_modules`, not both", "adapters")
    adapters = entry.get("adapters", entry.get("lora_modules"))
    if adapters is not None:
        kwargs["lora_modules"] = _lora_modules(adapters, where, "adapters" if "adapters" in entry else "lora_modules")
        if "enable_lora" not in entry:      # adapters listed: LoRA on (the CLI's default is off)
            kwargs["enable_lora"] = True
    if entry.get("kv_cache_memory") is not None:
        try:
            kwargs["kv_cache_memory"] = parse_size(entry["kv_cache_memory"], f"{where}: kv_cache_memory")
        except ValueError as exc:
            raise ModelEntryError(str(exc), "kv_cache_memory") from None
    dp = entry.get("data_parallel_size", 1)
    if isinstance(dp, bool) or not isinstance(dp, int) or dp < 1:
        raise ModelEntryError(f"{where}: data_parallel_size must be an integer >= 1, got {dp!r}", "data_parallel_size")
    share = entry.get("kv_cache_share", 1.0)
    if isinstance(share, bool) or not isinstance(share, (int, float)) or share <= 0:
        raise ModelEntryError(f"{where}: kv_cache_share must be a positive number, got {share!r}", "kv_cache_share")
    settings: dict[str, Any] = {}
    aliases = entry.get("served_model_name")
    if aliases is not None:
        aliases = [aliases] if isinstance(aliases, str) else aliases
        if not isinstance(aliases, list) or not all(isinstance(a, str) and a for a in aliases):
            raise ModelEntryError(f"{where}: served_model_name must be a name or a list of names", "served_model_name")
    settings["served_model_names"] = list(dict.fromkeys([name] + list(aliases or [])))
    template = entry.get("chat_template")
    if template is not None:
        if not isinstance(template, str):
            raise ModelEntryError(f"{where}: chat_template must be a file or a Jinja template", "chat_template")
        if os.path.isfile(template):
            with open(template, encoding="utf-8") as fh:
                template = fh.read()
        elif not any(tag in template for tag in ("{{", "{%")):
            raise ModelEntryError(f"{where}: chat_template {template!r}: no such file (and not a Jinja template)",
                                  "chat_template")
        settings["chat_template"] = template
    for key in ("tool_call_parser", "reasoning_parser", "enable_auto_tool_choice"):
        if key in entry:
            settings[key] = entry[key]
    if entry.get("reasoning_parser"):
        kwargs["reasoning_parser"] = entry["reasoning_parser"]
    for key in ("tool_call_parser", "reasoning_parser"):
        if settings.get(key) is not None:
            from .chat_output import parser_class
            try:
                parser_class(key.replace("_call", ""), settings[key])
            except ValueError as exc:
                raise ModelEntryError(f"{where}: {exc}", key) from None
    return ModelSpec(name, kwargs, dp, float(share), settings, frozenset(entry))


def _lora_modules(value: Any, where: str, key: str) -> list[Any]:
    """A model's adapters as the engine's lora_modules entries: {name: path}, or a list of name=path strings or
    {name, path} mappings (--lora-modules' forms)."""
    if isinstance(value, dict):
        value = [[str(k), str(v)] for k, v in value.items()]
    if not isinstance(value, list) or not all(
            isinstance(x, str) or (isinstance(x, dict) and {"name", "path"} <= set(x)) or isinstance(x, list)
            for x in value):
        raise ModelEntryError(f"{where}: {key} must map adapter names to paths ({{sql: /adapters/sql}}) or list "
                              f"name=path entries, got {value!r}", key)
    return value


def parse_models_file(path: str, base_kwargs: dict[str, Any]) -> list[ModelSpec]:
    """The ModelSpecs of a --models YAML file; ValueError saying what is wrong, and where."""
    import yaml
    where = f"--models {path}"
    try:
        with open(path, encoding="utf-8") as fh:
            doc = yaml.safe_load(fh)
    except OSError as exc:
        raise ValueError(f"{where}: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        raise ValueError(f"{where}: not valid YAML: {exc}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("models"), list) or not doc["models"]:
        raise ValueError(f"{where}: expected a top-level `models:` list with at least one model")
    extra = sorted(set(doc) - {"models"})
    if extra:
        raise ValueError(f"{where}: unknown top-level key {extra[0]!r} (only `models:` is read)")
    specs = [spec_from_entry(entry, base_kwargs, where) for entry in doc["models"]]
    names: dict[str, str] = {}
    for spec in specs:
        for alias in spec.settings["served_model_names"]:
            if alias in names:
                raise ValueError(f"{where}: the name {alias!r} is used by two models ({names[alias]!r} and "
                                 f"{spec.name!r})")
            names[alias] = spec.name
    return specs


def split_budget(specs: list[ModelSpec], kv_cache_memory: Optional[int], gpu_memory_utilization: float) -> None:
    """Divide the server's KV budget between the models that did not set their own, by kv_cache_share; on a
    device several engines share (models, or one model's replicas), --gpu-memory-utilization too: each engine
    would otherwise take it all."""
    shared = [s for s in specs if "kv_cache_memory" not in s.explicit]
    if kv_cache_memory is not None and shared:
        total = sum(s.kv_cache_share for s in shared)
        for s in shared:
            s.engine_kwargs["kv_cache_memory"] = int(kv_cache_memory * s.kv_cache_share / total)
    by_device: dict[str, list[ModelSpec]] = {}
    for s in specs:
        if "gpu_memory_utilization" not in s.explicit:
            by_device.setdefault(str(s.engine_kwargs.get("device", "auto")), []).append(s)
    for group in by_device.values():
        if sum(s.data_parallel_size for s in group) > 1:
            total = sum(s.kv_cache_share * s.data_parallel_size for s in group)
            for s in group:
                s.engine_kwargs["gpu_memory_utilization"] = gpu_memory_utilization * s.kv_cache_share / total


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def split_threads(specs: list[ModelSpec], cores: Optional[int] = None) -> None:
    """Each engine without --num-threads / num_threads gets cores / engines CPU threads (at least 1)."""
    cores = cores or available_cores()
    engines = sum(s.data_parallel_size for s in specs)
    if engines <= 1:
        return
    each = max(1, cores // engines)
    for s in specs:
        if s.engine_kwargs.get("num_threads") is None:
            s.engine_kwargs["num_threads"] = each
            name = s.name or s.engine_kwargs.get("model") or "(default)"
            logger.info("model %r: %d engine process%s, --num-threads %d each (%d cores / %d engines)", name,
                        s.data_parallel_size, "" if s.data_parallel_size == 1 else "es", each, cores, engines)


def make_engines(spec: ModelSpec, factory: Optional[str], log_level: int) -> Engines:
    if spec.data_parallel_size == 1:
        return EngineClient(spec.engine_kwargs, factory=factory, log_level=log_level)
    return ReplicaSet(spec.engine_kwargs, spec.data_parallel_size, factory=factory, log_level=log_level)


@dataclass
class ModelTable:
    """The engines of `--models FILE`, before the app starts them: spawned together, shut down together."""
    specs: list[ModelSpec]
    clients: list[Engines]
    base_kwargs: dict[str, Any]          # what a model loaded at run time starts from (the command line's)
    factory: Optional[str] = None
    log_level: int = logging.INFO

    def spawn(self) -> None:
        for client in self.clients:
            client.spawn()

    @property
    def is_closing(self) -> bool:
        return all(client.is_closing for client in self.clients)

    def shutdown(self, timeout: float = 10.0) -> None:
        for client in self.clients:
            client.shutdown(timeout)


def add_model_table_args(group: Any) -> None:
    group.add_argument("--models", default=None, metavar="FILE",
                       help="serve several models on one port: a YAML file (name, model/path, device, engine "
                            "options, kv_cache_memory or kv_cache_share, data_parallel_size, lora_modules per "
                            "model; docs/serving.md, Several models), one engine process per model, routed by "
                            "the request's `model`")
    group.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                       help="engine replicas of the model behind one API; each request goes to the replica with "
                            "the longest cached prefix of its prompt, then the least loaded (default 1)")


def build_engines(args: Any, kwargs: dict[str, Any], log_level: int) -> Union[Engines, ModelTable]:
    """One engine, -dp replicas of it, or the models of --models FILE (SystemExit for a bad file or flag)."""
    dp = getattr(args, "data_parallel_size", 1) or 1
    factory = getattr(args, "engine_factory", None)
    models_file = getattr(args, "models", None)
    if dp < 1:
        raise SystemExit(f"--data-parallel-size must be >= 1, got {dp}")
    if models_file is None:
        spec = ModelSpec(kwargs.get("served_model_name") or "", kwargs, dp)
        split_budget([spec], None, kwargs.get("gpu_memory_utilization", 0.9))     # replicas share the device
        split_threads([spec])
        return make_engines(spec, factory, log_level)
    if args.model is not None or args.served_model_name:
        raise SystemExit("--models FILE names the models and their names: leave out MODEL / --model and "
                         "--served-model-name")
    if dp != 1:
        raise SystemExit("with --models FILE, give data_parallel_size per model in the file")
    base = {k: v for k, v in kwargs.items() if k != "model"}
    try:
        specs = parse_models_file(models_file, base)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    split_budget(specs, kwargs.get("kv_cache_memory"), kwargs.get("gpu_memory_utilization", 0.9))
    split_threads(specs)
    return ModelTable(specs, [make_engines(s, factory, log_level) for s in specs], base, factory, log_level)
