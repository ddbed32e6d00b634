"""Stop-string detection over incrementally growing text (pure functions)."""
from __future__ import annotations

from typing import Optional, Sequence


def find_stop_string(text: str, new_char_count: int, stop: Sequence[str],
                     include_stop_str_in_output: bool = False) -> Optional[tuple[str, int]]:
    """Find the earliest stop string that the last ``new_char_count`` characters of ``text`` completed.

    Only the region the new text can affect is searched: a match must end inside the new text, so it
    starts at or after ``len(text) - new_char_count - len(stop_str) + 1``. (Text before that was
    already checked when it was new.) Returns ``(stop_str, truncate_to)`` where ``text[:truncate_to]``
    is the text to keep — up to the start of the stop string, or up to its end when
    ``include_stop_str_in_output`` — or None when no stop string appears. Between matches at the same
    position, the first in ``stop`` wins.
    """
    if not stop or new_char_count <= 0:
        return None
    n = len(text)
    new_start = n - min(new_char_count, n)
    best: Optional[tuple[int, str]] = None
    for s in stop:
        if not s:
            continue
        begin = max(0, new_start - len(s) + 1)
        # Cap the search at the best match so far: later matches cannot win.
        end = n if best is None else min(n, best[0] + len(s) - 1)
        idx = text.find(s, begin, end)
        if idx != -1 and (best is None or idx < best[0]):
            best = (idx, s)
    if best is None:
        return None
    idx, s = best
    return s, (idx + len(s) if include_stop_str_in_output else idx)
