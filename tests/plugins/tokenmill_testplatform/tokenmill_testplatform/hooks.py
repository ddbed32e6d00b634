"""A pluggy hook subscriber (entry-point group `tokenmill.hooks`): records every request event."""
from __future__ import annotations

from tokenmill.plugins.hookspecs import hookimpl

EVENTS: list = []     # what the tests read back


class EventRecorder:
    @hookimpl
    def tokenmill_request_event(self, event):
        EVENTS.append(event)
