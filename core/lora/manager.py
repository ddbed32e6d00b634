"""Which adapters exist, which are in host memory, which sit in a device slot, and who uses them.

Three tiers, as in vLLM: every adapter the engine knows by name (--lora-modules, load_lora_adapter,
or a LoRARequest's path); up to `max_cpu_loras` read into host memory (least recently used dropped,
re-read from disk when needed again); `max_loras` slots on the device. A sequence takes its
adapter's slot when the scheduler admits it (`acquire`) and gives it back when it stops running
(`release`); a slot nobody uses is reloaded with another adapter, least recently used first, and
counted as a swap. A sequence whose adapter finds no free slot waits; it never fails.
"""
from __future__ import annotations

import logging
from collections import Counter, OrderedDict
from typing import Any, Optional, Union

import torch

from ..errors import RequestError
from ..layers.linear import Linear
from .adapter import LoRAAdapter, LoRAAdapterError, LoRATarget, load_adapter, lora_targets
from .config import LoRAConfig, parse_lora_modules
from .layers import AddLoRA, LoRAContext, LoRALayer
from .punica import add_lora as add_lora_torch
from .punica import build_mapping
from .request import LoRARequest

logger = logging.getLogger("tokenmill.lora")


class LoRAManager:
    def __init__(self, config: LoRAConfig, model: torch.nn.Module, dtype: torch.dtype, device: torch.device,
                 add_lora: Optional[AddLoRA] = None) -> None:
        self.config = config
        self.device = device
        plain = getattr(model, "lora_plain_modules", ("o_proj", "down_proj"))
        self.targets: dict[str, LoRATarget] = lora_targets(getattr(model, "packed_modules_mapping", {}), plain)
        self.context = LoRAContext()
        self.layers: dict[str, LoRALayer] = {}
        suffixes = {t.layer_suffix for t in self.targets.values()}
        for name, module in model.named_modules():
            if isinstance(module, Linear) and name.rsplit(".", 1)[-1] in suffixes:
                layer = LoRALayer(module.output_sizes, module.input_size, config.max_loras, config.max_lora_rank,
                                  self.context, add_lora or add_lora_torch, dtype, device)
                module.lora = layer
                self.layers[name] = layer
        if not self.layers:
            raise ValueError("enable_lora: this model has no layers LoRA adapters can target")
        self.registry: dict[str, LoRARequest] = {}            # name -> request (paths known)
        self.cpu_cache: OrderedDict[int, LoRAAdapter] = OrderedDict()   # id -> weights, LRU first
        self.slot_ids: list[Optional[int]] = [None] * config.max_loras  # adapter id per slot
        self.slot_users = [0] * config.max_loras
        self.slot_lru: OrderedDict[int, None] = OrderedDict()  # slots, least recently used first
        self.num_swaps = 0           # adapters loaded into a slot (vLLM counts these as swaps in)
        self.num_evictions = 0       # resident adapters replaced by another
        self._last_id = 1 << 20      # ids handed out by next_id(), above any a user picks

    # ------------------------------------------------------------------ adapters by name
    def add_adapter(self, request: LoRARequest) -> LoRAAdapter:
        """Register (and read, validating) an adapter; LoRAAdapterError when it cannot run here."""
        known = self.registry.get(request.lora_name)
        if known is not None and known.lora_int_id != request.lora_int_id:
            raise LoRAAdapterError(f"a LoRA adapter named {request.lora_name!r} is already loaded", "lora_name")
        same_id = next((r for r in self.registry.values() if r.lora_int_id == request.lora_int_id), None)
        if same_id is not None and same_id.lora_name != request.lora_name:   # the id keys slots and cached KV
            raise LoRAAdapterError(f"lora_int_id {request.lora_int_id} is already the id of LoRA adapter "
                                   f"{same_id.lora_name!r}", "lora_int_id")
        adapter = self._read(request)
        self.registry[request.lora_name] = request
        return adapter

    def remove_adapter(self, name: str) -> bool:
        request = self.registry.pop(name, None)
        if request is None:
            return False
        self.cpu_cache.pop(request.lora_int_id, None)
        for slot, adapter_id in enumerate(self.slot_ids):
            if adapter_id == request.lora_int_id and self.slot_users[slot] == 0:
                self._clear(slot)
        return True

    def next_id(self) -> int:
        """A fresh adapter id for an adapter loaded by name (never reused: ids key slots and the prefix cache)."""
        self._last_id = max([self._last_id] + [r.lora_int_id for r in self.registry.values()]) + 1
        return self._last_id

    def resolve(self, lora_request: Union[LoRARequest, str]) -> LoRARequest:
        """The request's adapter, registered (and validated) on first use; RequestError when unknown."""
        if isinstance(lora_request, str):
            request = self.registry.get(lora_request)
            if request is None:
                raise RequestError(f"The model `{lora_request}` does not exist.", "model", "model_not_found")
            return request
        if not isinstance(lora_request, LoRARequest):
            raise RequestError(f"lora_request must be a LoRARequest, got {type(lora_request).__name__}",
                               "lora_request", "invalid_type")
        known = self.registry.get(lora_request.lora_name)
        if known is not None and known.lora_int_id == lora_request.lora_int_id:
            return known
        try:
            self.add_adapter(lora_request)
        except LoRAAdapterError as e:
            raise RequestError(str(e), e.param, "invalid_value") from None
        return lora_request

    def _read(self, request: LoRARequest) -> LoRAAdapter:
        adapter = self.cpu_cache.get(request.lora_int_id)
        if adapter is not None:
            self.cpu_cache.move_to_end(request.lora_int_id)
            return adapter
        adapter = load_adapter(request, self.targets, self.config.max_lora_rank, set(self.layers))
        self.cpu_cache[request.lora_int_id] = adapter
        while len(self.cpu_cache) > self.config.cpu_capacity:
            self.cpu_cache.popitem(last=False)
        return adapter

    # ------------------------------------------------------------------ slots
    def acquire(self, seq: Any) -> bool:
        """Give `seq` its adapter's slot (loading the adapter into a free one if needed). False:
        every slot is in use by running sequences of other adapters, so `seq` waits."""
        request: Optional[LoRARequest] = seq.lora_request
        if request is None or seq.lora_slot >= 0:
            return True
        slot = next((s for s, i in enumerate(self.slot_ids) if i == request.lora_int_id), None)
        if slot is None:
            free = [s for s, users in enumerate(self.slot_users) if users == 0]
            if not free:
                return False
            empty = [s for s in free if self.slot_ids[s] is None]
            # An empty slot first, else the least recently used adapter nobody runs on.
            slot = empty[0] if empty else next(s for s in self.slot_lru if self.slot_users[s] == 0)
            self._load(slot, request)
        self.slot_users[slot] += 1
        self.slot_lru[slot] = None
        self.slot_lru.move_to_end(slot)
        seq.lora_slot = slot
        return True

    def can_acquire(self, seq: Any) -> bool:
        """Would `acquire` succeed now (its adapter resident, or a slot nobody uses)?"""
        request = seq.lora_request
        if request is None or seq.lora_slot >= 0 or request.lora_int_id in self.slot_ids:
            return True
        return 0 in self.slot_users

    def release(self, seq: Any) -> None:
        if getattr(seq, "lora_slot", -1) < 0:
            return
        self.slot_users[seq.lora_slot] -= 1
        if self.slot_users[seq.lora_slot] == 0 and self.registry.get(seq.lora_request.lora_name) != seq.lora_request:
            self._clear(seq.lora_slot)          # unloaded while it ran: its weights must not be found again
        seq.lora_slot = -1

    def _load(self, slot: int, request: LoRARequest) -> None:
        adapter = self._read(request)
        if self.slot_ids[slot] is not None:
            self.num_evictions += 1
        for name, layer in self.layers.items():
            layer.set_slot(slot, adapter.layers.get(name))
        self.slot_ids[slot] = request.lora_int_id
        self.num_swaps += 1
        logger.debug("LoRA adapter %s loaded into slot %d", request.lora_name, slot)

    def _clear(self, slot: int) -> None:
        for layer in self.layers.values():
            layer.set_slot(slot, None)
        self.slot_ids[slot] = None
        self.slot_lru.pop(slot, None)

    # ------------------------------------------------------------------ per step
    def set_mapping(self, row_slots: list[tuple[int, int]]) -> None:
        """The step's (slot, rows) per sequence in batch order, read by every LoRA layer of the next forward
        (each step's replaces the last: the model runner sets it when it prepares a step)."""
        self.context.mapping = build_mapping(row_slots, self.device)

    def counters(self, running: list, waiting: list) -> dict[str, Any]:
        """For EngineStats: requests running and waiting per adapter, swap counts, slots."""
        def by_name(seqs: list) -> dict[str, int]:
            return dict(Counter(name for name, _ in {(s.lora_request.lora_name, s.request_id)
                                                     for s in seqs if s.lora_request is not None}))
        return {"lora_running": by_name(running), "lora_waiting": by_name(waiting),
                "lora_swaps": self.num_swaps, "lora_evictions": self.num_evictions,
                "max_loras": self.config.max_loras}


def attach_lora(config: Any, model: torch.nn.Module, platform: Any, dtype: torch.dtype) -> Optional[LoRAManager]:
    """With enable_lora: adapter slots on the model's layers (the platform's batched op if it has
    one, else torch's) and the --lora-modules registered. None without."""
    if not config.lora.enable_lora:
        return None
    kernels = getattr(platform, "lora_kernels", None)
    manager = LoRAManager(config.lora, model, dtype, platform.device(), kernels() if kernels else None)
    for name, path in parse_lora_modules(config.lora.lora_modules):
        try:
            manager.add_adapter(LoRARequest(name, manager.next_id(), path))
        except LoRAAdapterError as e:
            raise ValueError(f"lora_modules {name}={path}: {e}") from None
    return manager


def enabled(manager: Optional[LoRAManager]) -> LoRAManager:
    """The engine's manager; a RequestError (a ValueError) naming lora_request when LoRA is off."""
    if manager is None:
        raise RequestError("LoRA adapters are not enabled (start with enable_lora / --enable-lora)",
                           "lora_request", "invalid_value")
    return manager


def cache_salt(request: Optional[LoRARequest]) -> Optional[int]:
    """What a sequence's first prefix-cache block hash starts from: None for the base model, the
    adapter's id otherwise, so two adapters never share cached KV (their K/V differ)."""
    return None if request is None else hash(("lora", request.lora_int_id))
