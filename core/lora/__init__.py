"""Multi-LoRA serving: PEFT adapters, device slots, the batched per-row LoRA op."""
from .request import LoRARequest

__all__ = ["LoRARequest"]
