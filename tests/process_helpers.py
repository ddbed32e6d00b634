"""Live processes read from /proc, for tests that check nothing is left behind."""
from __future__ import annotations

import os

# Fields of /proc/PID/stat after the command name: 0 state, 1 parent pid, 3 session id.
PARENT_PID, SESSION_ID = 1, 3


def live_processes(field: int, value: int) -> list[int]:
    """Pids of live (not zombie) processes whose /proc stat `field` equals `value`."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[field]) == value and fields[0] not in ("Z", "X"):
            found.append(int(entry))
    return found


def children(pid: int) -> list[int]:
    return live_processes(PARENT_PID, pid)


def session_members(sid: int) -> list[int]:
    """Live processes in session `sid` (ServerProcess starts the server as a session leader: its
    engine process and anything else it spawned stay in that session)."""
    return live_processes(SESSION_ID, sid)


def is_alive(pid: int) -> bool:
    """The process runs (exists and is not a zombie)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False
