"""The streamed events of POST /v1/responses (`stream: true`), as the openai SDK's stream helper
accumulates them: every event carries a `sequence_number`; each output item opens with
`response.output_item.added`, and closes with `response.output_item.done` carrying the same ids:

  reasoning (with --reasoning-parser): content_part.added (reasoning_text), reasoning_text.delta …,
      reasoning_text.done, content_part.done
  message:       content_part.added (output_text), output_text.delta …, output_text.done, content_part.done
  function_call: function_call_arguments.delta …, function_call_arguments.done

`feed` takes the chat deltas of the answer (chat_output.ChatChoiceOutput: reasoning_content,
content, tool_calls) as the engine's deltas come in; an item closes when another kind starts.
"""
from __future__ import annotations

from typing import Any, Optional

from .http import dumps
from .protocol_responses import (function_call_item, message_item, new_id, output_text_part,
                                 reasoning_item)


class StreamedItems:
    def __init__(self) -> None:
        self.sequence = 0
        self.items: list[dict[str, Any]] = []     # the finished items, for the final response
        self.open: Optional[str] = None            # "reasoning", "message", or "call:<chat call index>"
        self.item: dict[str, Any] = {}             # the open item (completed as it closes)
        self.text = ""                              # the open item's text or arguments so far

    def event(self, kind: str, **fields: Any) -> str:
        """One SSE event (the SDK reads `data:`; `event:` names it for other clients)."""
        data = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {dumps(data)}\n\n"

    # ------------------------------------------------------------------ items
    def _start(self, kind: str, item: dict[str, Any]) -> list[str]:
        out = self.close()
        self.open, self.item, self.text = kind, item, ""
        index = len(self.items)
        out.append(self.event("response.output_item.added", output_index=index, item=item))
        if item["type"] == "message":
            out.append(self.event("response.content_part.added", item_id=item["id"], output_index=index,
                                  content_index=0, part=output_text_part("")))
        elif item["type"] == "reasoning":
            out.append(self.event("response.content_part.added", item_id=item["id"], output_index=index,
                                  content_index=0, part={"type": "reasoning_text", "text": ""}))
        return out

    def close(self, incomplete: bool = False) -> list[str]:
        """Close the open item (if any): its done events, and it joins the finished items."""
        if self.open is None:
            return []
        item, index, text = self.item, len(self.items), self.text
        ids = {"item_id": item["id"], "output_index": index}
        out = []
        if item["type"] == "message":
            done = message_item(item["id"], text, "incomplete" if incomplete else "completed")
            out.append(self.event("response.output_text.done", **ids, content_index=0, text=text, logprobs=[]))
            out.append(self.event("response.content_part.done", **ids, content_index=0, part=output_text_part(text)))
        elif item["type"] == "reasoning":
            done = reasoning_item(item["id"], text, "completed")
            out.append(self.event("response.reasoning_text.done", **ids, content_index=0, text=text))
            out.append(self.event("response.content_part.done", **ids, content_index=0,
                                  part={"type": "reasoning_text", "text": text}))
        else:
            done = function_call_item(item["id"], item["call_id"], item["name"], text, "completed")
            out.append(self.event("response.function_call_arguments.done", **ids, name=item["name"], arguments=text))
        out.append(self.event("response.output_item.done", output_index=index, item=done))
        self.items.append(done)
        self.open, self.item, self.text = None, {}, ""
        return out

    def ensure_output(self) -> list[str]:
        """An answer with no output at all is still one (empty) message."""
        if self.items or self.open is not None:
            return []
        return self._start("message", message_item(new_id("msg"), None, "in_progress"))

    def feed(self, delta: dict[str, Any]) -> list[str]:
        """The events for one chat delta of the answer."""
        out: list[str] = []
        if delta.get("reasoning_content"):
            if self.open != "reasoning":
                out += self._start("reasoning", reasoning_item(new_id("rs"), None, "in_progress"))
            self.text += delta["reasoning_content"]
            out.append(self.event("response.reasoning_text.delta", item_id=self.item["id"],
                                  output_index=len(self.items), content_index=0, delta=delta["reasoning_content"]))
        if delta.get("content"):
            if self.open != "message":
                out += self._start("message", message_item(new_id("msg"), None, "in_progress"))
            self.text += delta["content"]
            out.append(self.event("response.output_text.delta", item_id=self.item["id"], output_index=len(self.items),
                                  content_index=0, delta=delta["content"], logprobs=[]))
        for call in delta.get("tool_calls") or []:
            fn = call.get("function") or {}
            kind = f"call:{call['index']}"
            if call.get("id") is not None:      # a new call
                out += self._start(kind, function_call_item(new_id("fc"), call["id"], fn.get("name") or "", "",
                                                            "in_progress"))
            elif self.open != kind:
                continue
            if fn.get("arguments"):
                self.text += fn["arguments"]
                out.append(self.event("response.function_call_arguments.delta", item_id=self.item["id"],
                                      output_index=len(self.items), delta=fn["arguments"]))
        return out
