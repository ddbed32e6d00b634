"""Bounds on one request (serve flags, docs/serving.md "Limits and timeouts"): how many prompts, choices,
stop strings, stop token ids and logit_bias entries it may carry, how many bytes a prompt may have
before it is refused without being tokenized, whether it may bring its own chat template and how long
a template may render. Each refusal is a 400 naming the parameter."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping, Optional

if TYPE_CHECKING:
    from .errors import APIError


def _bad_request(message: str, param: str, code: str) -> "APIError":
    from .errors import bad_request    # here: building the CLI's flags (`tokenmill --help`) needs none of the server
    return bad_request(message, param, code)


@dataclass
class RequestLimits:
    max_prompts_per_request: int = 64       # a /v1/completions prompt list
    max_n: int = 128                        # OpenAI's own bound on n
    max_sequences_per_request: int = 512    # prompts x n: what one request adds to the scheduler
    max_stop_sequences: int = 16
    max_stop_token_ids: int = 256
    max_logit_bias: int = 300
    # None: derived from the context (max_model_len x the longest token's bytes, `prompt_byte_bound`); 0: off
    max_prompt_bytes: Optional[int] = None
    trust_request_chat_template: bool = False   # a request's own chat_template is rendered (in the sandbox)
    chat_template_timeout: float = 5.0          # seconds a chat template may take to render

    def check(self, req: Any, num_prompts: int = 1, rename: Optional[Mapping[str, str]] = None) -> None:
        """Refuse (400) a request beyond the bounds; `rename` maps a parameter to the route's name for it."""
        def name(param: str) -> str:
            return (rename or {}).get(param, param)

        if num_prompts > self.max_prompts_per_request:
            raise _bad_request(f"At most {self.max_prompts_per_request} prompts per request (--max-prompts-per-"
                                f"request), got {num_prompts}.", name("prompt"), "invalid_value")
        n = getattr(req, "n", None)
        n = 1 if n is None else n
        if n > self.max_n:
            raise _bad_request(f"n must be at most {self.max_n} (--max-n), got {n}.", name("n"), "invalid_value")
        if num_prompts * n > self.max_sequences_per_request:
            raise _bad_request(f"{num_prompts} prompts x n={n} is {num_prompts * n} sequences; at most "
                                f"{self.max_sequences_per_request} per request (--max-sequences-per-request).",
                                name("n"), "invalid_value")
        stop = getattr(req, "stop", None)
        if isinstance(stop, list) and len(stop) > self.max_stop_sequences:
            raise _bad_request(f"At most {self.max_stop_sequences} stop sequences (--max-stop-sequences), got "
                                f"{len(stop)}.", name("stop"), "invalid_value")
        ids = getattr(req, "stop_token_ids", None)
        if ids is not None and len(ids) > self.max_stop_token_ids:
            raise _bad_request(f"At most {self.max_stop_token_ids} stop_token_ids (--max-stop-token-ids), got "
                                f"{len(ids)}.", name("stop_token_ids"), "invalid_value")
        bias = getattr(req, "logit_bias", None)
        if bias is not None and len(bias) > self.max_logit_bias:
            raise _bad_request(f"At most {self.max_logit_bias} logit_bias entries (--max-logit-bias), got "
                                f"{len(bias)}.", name("logit_bias"), "invalid_value")


def longest_token_bytes(tokenizer: Any) -> int:
    """An upper bound on the UTF-8 bytes of text one token stands for: the longest token as the vocabulary
    spells it. Byte-level BPE spells each byte as one character (1-2 bytes), SentencePiece spells a space
    as '▁' (3 bytes) and a byte fallback as '<0x0A>' (6): the spelling is never shorter than the text."""
    longest = 1
    for token in tokenizer.convert_ids_to_tokens(list(range(len(tokenizer)))):
        if isinstance(token, str):
            longest = max(longest, len(token.encode("utf-8", "surrogatepass")))
    return longest


def prompt_byte_bound(limits: RequestLimits, max_model_len: int, tokenizer: Any) -> int:
    """The prompt bytes beyond which a prompt provably cannot fit the context (0: no bound)."""
    if limits.max_prompt_bytes is not None:
        return limits.max_prompt_bytes
    return max_model_len * longest_token_bytes(tokenizer)


def check_prompt_bytes(text: str, bound: int, max_model_len: int, param: str) -> None:
    """Refuse (400, context_length_exceeded) a text too long in bytes for the context, before tokenizing it."""
    if not bound or len(text) * 4 <= bound:     # a character is at most 4 bytes: surely within
        return
    size = len(text) if len(text) > bound else len(text.encode("utf-8", "surrogatepass"))
    if size > bound:
        raise prompt_too_long(size, bound, max_model_len, param)


def prompt_too_long(size: int, bound: int, max_model_len: int, param: str) -> "APIError":
    return _bad_request(f"This model's maximum context length is {max_model_len} tokens. However, your prompt has "
                         f"at least {size} bytes, more than {max_model_len} tokens can hold ({bound} bytes, "
                         "--max-prompt-bytes). Please reduce the length of the prompt.", param,
                         "context_length_exceeded")


def add_limit_args(group: Any) -> None:
    """The serve flags for RequestLimits (docs/serving.md, "Limits and timeouts")."""
    d = RequestLimits()
    group.add_argument("--max-prompts-per-request", type=int, default=d.max_prompts_per_request, metavar="N",
                       help=f"refuse (400, param prompt) a /v1/completions prompt list longer than N "
                            f"(default {d.max_prompts_per_request})")
    group.add_argument("--max-n", type=int, default=d.max_n, metavar="N",
                       help=f"refuse (400, param n) more than N choices per prompt (default {d.max_n}, OpenAI's)")
    group.add_argument("--max-sequences-per-request", type=int, default=d.max_sequences_per_request, metavar="N",
                       help=f"refuse (400, param n) prompts x n beyond N sequences (default "
                            f"{d.max_sequences_per_request})")
    group.add_argument("--max-stop-sequences", type=int, default=d.max_stop_sequences, metavar="N",
                       help=f"refuse (400, param stop) more stop strings (default {d.max_stop_sequences})")
    group.add_argument("--max-stop-token-ids", type=int, default=d.max_stop_token_ids, metavar="N",
                       help=f"refuse (400, param stop_token_ids) more stop token ids (default {d.max_stop_token_ids})")
    group.add_argument("--max-logit-bias", type=int, default=d.max_logit_bias, metavar="N",
                       help=f"refuse (400, param logit_bias) more logit_bias entries (default {d.max_logit_bias})")
    group.add_argument("--max-prompt-bytes", type=int, default=None, metavar="B",
                       help="refuse (400, context_length_exceeded) a prompt or chat of more than B bytes without "
                            "tokenizing it (default: max_model_len x the vocabulary's longest token in bytes, a "
                            "size that cannot fit the context; 0: no bound)")
    group.add_argument("--trust-request-chat-template", action="store_true",
                       help="render a chat_template sent in a request (or in its chat_template_kwargs), in a "
                            "sandbox process killed after --chat-template-timeout (default: refused, 400)")
    group.add_argument("--chat-template-timeout", type=float, default=d.chat_template_timeout, metavar="S",
                       help=f"a chat template that has not rendered after S seconds is a 400 (default "
                            f"{d.chat_template_timeout:g})")


def limits_from_args(parser: Any, args: Any) -> RequestLimits:
    """RequestLimits from the serve flags; a bound below 1 (or a timeout <= 0) exits with status 2."""
    counts = ("max_prompts_per_request", "max_n", "max_sequences_per_request", "max_stop_sequences",
              "max_stop_token_ids", "max_logit_bias")
    for name in counts:
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.max_prompt_bytes is not None and args.max_prompt_bytes < 0:
        parser.error(f"--max-prompt-bytes must be >= 0, got {args.max_prompt_bytes}")
    if args.chat_template_timeout <= 0:
        parser.error(f"--chat-template-timeout must be > 0, got {args.chat_template_timeout}")
    return RequestLimits(**{name: getattr(args, name) for name in counts}, max_prompt_bytes=args.max_prompt_bytes,
                         trust_request_chat_template=args.trust_request_chat_template,
                         chat_template_timeout=args.chat_template_timeout)
