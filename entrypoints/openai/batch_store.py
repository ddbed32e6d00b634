"""The on-disk state of /v1/files and /v1/batches, under `--batch-dir`:

  files/{file_id}.json        the file object (OpenAI's FileObject), written atomically
  files/{file_id}.jsonl       its content
  batches/{batch_id}.json     {"batch": the Batch object, "output_file": id, "error_file": id}, atomically

A batch's output and error files are chosen when the batch is created and written to as lines finish
(append + fsync, one line at a time); their file objects appear only when the batch is finalized. So after
a crash the lines in those files are exactly the finished ones (a torn last line is cut off), and resuming
skips their custom_ids: no line lost or duplicated.
"""
from __future__ import annotations

import json
import os
import tempfile
import time
import uuid
from collections import Counter
from typing import Any, Optional

from . import errors as E

DEFAULT_BATCH_DIR = os.path.join("~", ".cache", "tokenmill", "batches")
ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def write_atomic(path: str, obj: Any) -> None:
    """Write JSON so that a reader (or a restart) sees the old content or the new, never a mix."""
    directory = os.path.dirname(path)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump(obj, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def _read_json(path: str) -> Optional[Any]:
    try:
        with open(path, encoding="utf-8") as fh:
            return json.load(fh)
    except (OSError, ValueError):
        return None


class AppendLog:
    """A JSONL file lines are appended to, each one flushed and fsynced before `append` returns."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.fh = open(path, "ab")

    def append(self, line: str) -> None:
        self.fh.write(line.encode("utf-8"))
        self.fh.flush()
        os.fsync(self.fh.fileno())

    def close(self) -> None:
        self.fh.close()


def finished_ids(path: str) -> Counter:
    """The custom_ids of the complete lines of an output file (None for lines that had none), after cutting
    off a torn last line (a crash mid-write)."""
    done: Counter = Counter()
    if not os.path.exists(path):
        return done
    with open(path, "rb") as fh:
        data = fh.read()
    end = data.rfind(b"\n") + 1
    if end < len(data):
        with open(path, "r+b") as fh:
            fh.truncate(end)
            fh.flush()
            os.fsync(fh.fileno())
    for raw in data[:end].splitlines():
        try:
            done[json.loads(raw).get("custom_id")] += 1
        except (ValueError, AttributeError):
            continue
    return done


class BatchStore:
    def __init__(self, root: Optional[str]) -> None:
        self.root = os.path.abspath(os.path.expanduser(root or DEFAULT_BATCH_DIR))
        self.files_dir = os.path.join(self.root, "files")
        self.batches_dir = os.path.join(self.root, "batches")
        os.makedirs(self.files_dir, exist_ok=True)
        os.makedirs(self.batches_dir, exist_ok=True)
        self._lock: Any = None

    def lock(self) -> bool:
        """Take the directory for this process (an flock, released when the process dies): only one server
        runs a directory's jobs, or they would run twice. False: another process holds it."""
        import fcntl
        if self._lock is None:
            fh = open(os.path.join(self.root, ".lock"), "w")
            try:
                fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                fh.close()
                return False
            self._lock = fh
        return True

    # ------------------------------------------------------------------ files
    def content_path(self, file_id: str) -> str:
        return os.path.join(self.files_dir, f"{os.path.basename(file_id)}.jsonl")

    def _meta_path(self, file_id: str) -> str:
        return os.path.join(self.files_dir, f"{os.path.basename(file_id)}.json")

    def add_file(self, content: bytes, filename: str, purpose: str) -> dict[str, Any]:
        file_id = new_id("file")
        path = self.content_path(file_id)
        with open(path, "wb") as fh:
            fh.write(content)
            fh.flush()
            os.fsync(fh.fileno())
        return self.register_file(file_id, filename, purpose)

    def register_file(self, file_id: str, filename: str, purpose: str) -> dict[str, Any]:
        """The file object of content already at content_path(file_id)."""
        path = self.content_path(file_id)
        if not os.path.exists(path):
            open(path, "wb").close()
        meta = {"id": file_id, "object": "file", "bytes": os.path.getsize(path), "created_at": int(time.time()),
                "filename": filename, "purpose": purpose, "status": "processed", "expires_at": None,
                "status_details": None}
        write_atomic(self._meta_path(file_id), meta)
        return meta

    def get_file(self, file_id: str) -> dict[str, Any]:
        meta = _read_json(self._meta_path(file_id)) if file_id else None
        if meta is None:
            raise E.APIError(404, f"No such File object: {file_id}", "invalid_request_error", "file_id",
                             "file_not_found")
        return meta

    def list_files(self, purpose: Optional[str] = None) -> list[dict[str, Any]]:
        out = []
        for name in os.listdir(self.files_dir):
            if name.endswith(".json") and not name.startswith("."):
                meta = _read_json(os.path.join(self.files_dir, name))
                if meta is not None and (purpose is None or meta.get("purpose") == purpose):
                    out.append(meta)
        return sorted(out, key=lambda m: (m["created_at"], m["id"]), reverse=True)

    def read_content(self, file_id: str) -> bytes:
        self.get_file(file_id)
        with open(self.content_path(file_id), "rb") as fh:
            return fh.read()

    def delete_file(self, file_id: str) -> dict[str, Any]:
        self.get_file(file_id)
        os.unlink(self._meta_path(file_id))
        try:
            os.unlink(self.content_path(file_id))
        except FileNotFoundError:
            pass
        return {"id": file_id, "object": "file", "deleted": True}

    # ------------------------------------------------------------------ batches
    def _batch_path(self, batch_id: str) -> str:
        return os.path.join(self.batches_dir, f"{os.path.basename(batch_id)}.json")

    def save_batch(self, record: dict[str, Any]) -> None:
        write_atomic(self._batch_path(record["batch"]["id"]), record)

    def new_batch(self, input_file_id: str, endpoint: str, completion_window: str,
                  metadata: Optional[dict[str, Any]]) -> dict[str, Any]:
        now = int(time.time())
        batch = {"id": new_id("batch"), "object": "batch", "endpoint": endpoint, "errors": None,
                 "input_file_id": input_file_id, "completion_window": completion_window, "status": "validating",
                 "output_file_id": None, "error_file_id": None, "created_at": now, "in_progress_at": None,
                 "expires_at": now + 24 * 3600, "finalizing_at": None, "completed_at": None, "failed_at": None,
                 "expired_at": None, "cancelling_at": None, "cancelled_at": None,
                 "request_counts": {"total": 0, "completed": 0, "failed": 0}, "metadata": metadata}
        record = {"batch": batch, "output_file": new_id("file"), "error_file": new_id("file")}
        self.save_batch(record)
        return record

    def get_record(self, batch_id: str) -> dict[str, Any]:
        record = _read_json(self._batch_path(batch_id)) if batch_id else None
        if record is None:
            raise E.APIError(404, f"No such Batch object: {batch_id}", "invalid_request_error", "batch_id",
                             "batch_not_found")
        return record

    def list_records(self) -> list[dict[str, Any]]:
        out = []
        for name in os.listdir(self.batches_dir):
            if name.endswith(".json") and not name.startswith("."):
                record = _read_json(os.path.join(self.batches_dir, name))
                if record is not None:
                    out.append(record)
        return sorted(out, key=lambda r: (r["batch"]["created_at"], r["batch"]["id"]), reverse=True)
