"""Incremental detokenization with stop-string handling (vLLM's prefix-offset approach).

Each new token is decoded by converting a short window of tokens to a string twice — the
window ending before the new tokens (``prefix``) and the window including them — and emitting
the difference. The window starts a few tokens back so that tokenizers whose decoding of a token
depends on its neighbours (sentencepiece's leading-space handling, byte-level BPE tokens that
end mid-character) decode exactly as they do inside the full text. When the decoded text ends
in U+FFFD (an incomplete UTF-8 sequence) nothing is emitted and the window is kept, so the next
token completes the character. Only the window is kept, so each token costs O(window).
"""
from __future__ import annotations

from typing import Optional

from .stop_checker import find_stop_string

# How many prompt tokens to decode before the first generated one (vLLM uses 5).
_INITIAL_OFFSET = 5
_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True,
                 spaces_between_special_tokens: bool = True, stop: Optional[list[str]] = None,
                 include_stop_str_in_output: bool = False) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        if isinstance(stop, str):
            stop = [stop]
        self.stop: list[str] = [s for s in (stop or []) if s]
        self.include_stop_str_in_output = include_stop_str_in_output
        # Characters held back from streaming so a partial stop string is never sent.
        if self.stop and not include_stop_str_in_output:
            self.stop_buffer_length = max(len(s) for s in self.stop) - 1
        else:
            self.stop_buffer_length = 0

        self._fast = bool(getattr(tokenizer, "is_fast", False))
        self._special_ids = set(getattr(tokenizer, "all_special_ids", ()) or ())
        # A fast tokenizer's Rust backend, asked directly per token: transformers'
        # convert_ids_to_tokens recomputes all_special_ids on every call, for every token.
        self._backend = getattr(tokenizer, "backend_tokenizer", None) if self._fast else None
        added = {}
        if not self._fast:
            try:
                added = tokenizer.get_added_vocab() or {}
            except Exception:  # pragma: no cover - exotic tokenizers
                added = {}
        self._added_tokens = set(added)

        # Window of tokens (strings); _prefix_offset/_read_offset index into it.
        tail = list(prompt_token_ids[-(_INITIAL_OFFSET + 1):]) if prompt_token_ids else []
        self._tokens: list[str] = self._to_tokens(tail)
        self._prefix_offset = max(len(self._tokens) - _INITIAL_OFFSET, 0)
        self._read_offset = len(self._tokens)

        self._text = ""
        self._last_output_offset = 0
        self.stop_reason: Optional[str] = None
        self.token_count = 0

    # ------------------------------------------------------------------ public API
    @property
    def text(self) -> str:
        """Full output text so far (after stop-string truncation)."""
        return self._text

    @property
    def stopped(self) -> bool:
        return self.stop_reason is not None

    def append(self, token_ids: list[int]) -> Optional[str]:
        """Decode new tokens. Returns the matched stop string (text then truncated), else None."""
        if self.stop_reason is not None:
            return None
        before = len(self._text)
        pieces = []
        for tid in token_ids:
            self.token_count += 1
            piece = self._decode_next(tid)
            if piece:
                pieces.append(piece)
        if not pieces:
            return None
        self._text += "".join(pieces)
        if self.stop:
            hit = find_stop_string(self._text, len(self._text) - before, self.stop,
                                   self.include_stop_str_in_output)
            if hit is not None:
                stop_str, cut = hit
                self._text = self._text[:cut]
                self.stop_reason = stop_str
                return stop_str
        return None

    def output_text(self, finished: bool, delta: bool) -> str:
        """Text for streaming: not yet returned (delta) or all of it, holding back a possible partial
        stop string while not finished (a matched stop string finishes the text)."""
        finished = finished or self.stop_reason is not None
        hold = 0 if finished else self.stop_buffer_length
        length = len(self._text) - hold
        if not delta:
            return self._text[:length] if hold else self._text
        last = self._last_output_offset
        if last < length:
            self._last_output_offset = length
            return self._text[last:length]
        return ""

    # ------------------------------------------------------------------ internals
    def _to_tokens(self, ids: list[int]) -> list[str]:
        if not ids:
            return []
        if self._backend is not None:
            skip = self._special_ids if self.skip_special_tokens else ()
            return [t for t in (self._backend.id_to_token(i) for i in ids if i not in skip) if t is not None]
        toks = self.tokenizer.convert_ids_to_tokens(ids, skip_special_tokens=self.skip_special_tokens)
        if isinstance(toks, str):
            toks = [toks]
        return [t for t in toks if t is not None]

    def _tokens_to_string(self, tokens: list[str]) -> str:
        if not tokens:
            return ""
        if self._fast or not self._added_tokens:
            return self.tokenizer.convert_tokens_to_string(tokens)
        # Slow tokenizer with added tokens: added tokens are not part of the sentencepiece/BPE model,
        # so decode the runs between them separately (as transformers' decode does).
        sub_texts: list[str] = []
        current: list[str] = []
        for tok in tokens:
            if tok in self._added_tokens:
                if current:
                    sub_texts.append(self.tokenizer.convert_tokens_to_string(current))
                    current = []
                sub_texts.append(tok)
            else:
                current.append(tok)
        if current:
            sub_texts.append(self.tokenizer.convert_tokens_to_string(current))
        return (" " if self.spaces_between_special_tokens else "").join(sub_texts)

    def _decode_next(self, token_id: int) -> str:
        new_tokens = self._to_tokens([token_id])
        if not new_tokens:
            return ""   # a skipped special token
        self._tokens.extend(new_tokens)
        prefix_text = self._tokens_to_string(self._tokens[self._prefix_offset:self._read_offset])
        new_text = self._tokens_to_string(self._tokens[self._prefix_offset:])
        if len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT):
            # Incomplete character (or nothing visible yet): wait for the next token.
            return ""
        piece = new_text[len(prefix_text):]
        # Advance the window and drop the tokens before it (keeps the per-token cost constant).
        new_prefix = self._read_offset
        self._tokens = self._tokens[new_prefix:]
        self._prefix_offset = 0
        self._read_offset = len(self._tokens)
        return piece
