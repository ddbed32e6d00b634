"""Structured outputs under a reasoning parser: the constraint applies once the reasoning is over.

The engine builds the parser once (ModelConfig.reasoning_parser) and, per constrained request, a
gate: a test on the output text that turns True when the answer starts.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

from tokenmill.plugins import discovery


def make_reasoning_parser(name: Optional[str], tokenizer: Any) -> Any:
    """The reasoning parser structured outputs wait for (ModelConfig.reasoning_parser), or None."""
    if not name:
        return None
    found = discovery.reasoning_parsers()
    if name not in found:
        raise ValueError(f"reasoning_parser {name!r} is not a registered reasoning parser; known: "
                         f"{', '.join(sorted(found)) or '(none)'}")
    return found[name](tokenizer)


def reasoning_gate(parser: Any, tokenizer: Any, prompt_token_ids: list[int]) -> Optional[Callable[[str], bool]]:
    """None when the reasoning parser says the answer starts at once; else a test on the output
    text that turns True once the reasoning part is over (the constraint applies after it)."""
    prompt_text = tokenizer.decode(prompt_token_ids, skip_special_tokens=False)
    if parser.reasoning_ended(prompt_text, ""):
        return None
    return lambda output_text: parser.reasoning_ended(prompt_text, output_text)
