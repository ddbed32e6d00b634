"""Running /v1/batches jobs inside `tokenmill serve`, below interactive traffic.

A job's lines go through the app's own routes (batch_lines.py), at most `max_in_flight` of all jobs' lines at
once, each only while the engine's waiting queue holds at most `max_waiting` requests, and with an engine
priority that puts them after interactive requests (`--scheduling-policy priority`: preempted first, scheduled
last). Each finished line is appended (fsync) to the job's output or error file and the job's counts are
saved atomically (batch_store.py); a job the process did not finish is resumed when the server starts again,
skipping the custom_ids already written.

Status: validating → in_progress → finalizing → completed; failed (the file could not be run: unreadable,
duplicate custom_ids, empty); cancelling → cancelled (lines in flight finish, the rest are not run).
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from typing import Any, Optional

from . import errors as E
from .batch_lines import dumps_line, is_transient, output_record, parse_line, run_line, succeeded
from .batch_store import ACTIVE, AppendLog, BatchStore, finished_ids

logger = logging.getLogger("tokenmill.batch")

BATCH_PRIORITY = 10     # the engine serves a smaller number first; interactive requests default to 0


class _Stopped(Exception):
    """The server cannot run lines now (shutting down, engine dead): leave the job to be resumed."""


class BatchManager:
    def __init__(self, store: BatchStore, app: Any, max_in_flight: int = 4, max_waiting: int = 0,
                 priority: int = BATCH_PRIORITY) -> None:
        self.store = store
        self.app = app
        self.max_in_flight = max(1, max_in_flight)
        self.max_waiting = max_waiting
        self.priority = priority
        self.state: Any = None
        self.live: dict[str, dict[str, Any]] = {}     # the records of running jobs (newer than on disk)
        self.tasks: dict[str, asyncio.Task] = {}
        self._gate: Optional[asyncio.Semaphore] = None

    # ------------------------------------------------------------------ lifecycle
    def start(self, state: Any) -> None:
        """The engine is up: resume every unfinished job on disk (called in the event loop)."""
        if not self.store.lock():
            logger.warning("batch directory %s is in use by another process: this server runs no batch jobs "
                           "(start it with its own --batch-dir)", self.store.root)
            return
        self.state = state
        self._gate = asyncio.Semaphore(self.max_in_flight)
        for record in reversed(self.store.list_records()):
            if record["batch"]["status"] in ACTIVE:
                logger.info("resuming batch %s (%s)", record["batch"]["id"], record["batch"]["status"])
                self.launch(record)

    def stop(self) -> None:
        for task in self.tasks.values():
            task.cancel()

    def launch(self, record: dict[str, Any]) -> None:
        batch_id = record["batch"]["id"]
        if self.state is None or batch_id in self.tasks:
            return      # not started yet: start() picks it up
        self.live[batch_id] = record
        task = asyncio.get_running_loop().create_task(self._run(record))
        self.tasks[batch_id] = task
        task.add_done_callback(lambda _t: (self.tasks.pop(batch_id, None), self.live.pop(batch_id, None)))

    # ------------------------------------------------------------------ the routes' side
    def record(self, batch_id: str) -> dict[str, Any]:
        return self.live.get(batch_id) or self.store.get_record(batch_id)

    def create(self, input_file_id: str, endpoint: str, completion_window: str,
               metadata: Optional[dict[str, Any]]) -> dict[str, Any]:
        meta = self.store.get_file(input_file_id)
        if meta.get("purpose") != "batch":
            raise E.bad_request(f"File {input_file_id} has purpose {meta.get('purpose')!r}, not 'batch'.",
                                "input_file_id", "invalid_value")
        record = self.store.new_batch(input_file_id, endpoint, completion_window, metadata)
        if self.state is not None:
            self.launch(record)
        return record["batch"]

    def cancel(self, batch_id: str) -> dict[str, Any]:
        record = self.record(batch_id)
        batch = record["batch"]
        if batch["status"] in ("cancelling", "cancelled"):
            return batch
        if batch["status"] not in ("validating", "in_progress"):
            raise E.APIError(409, f"Cannot cancel a batch with status {batch['status']!r}.", "invalid_request_error",
                             None, "batch_not_cancellable")
        batch["status"], batch["cancelling_at"] = "cancelling", int(time.time())
        self.store.save_batch(record)
        return batch

    # ------------------------------------------------------------------ a job
    def _fail(self, record: dict[str, Any], code: str, message: str, line: Optional[int] = None) -> None:
        batch = record["batch"]
        batch["status"], batch["failed_at"] = "failed", int(time.time())
        batch["errors"] = {"object": "list", "data": [{"code": code, "message": message, "param": None,
                                                       "line": line}]}
        self.store.save_batch(record)

    def _lines(self, record: dict[str, Any]) -> Optional[list[Any]]:
        batch = record["batch"]
        try:
            text = self.store.read_content(batch["input_file_id"]).decode("utf-8")
        except (E.APIError, UnicodeDecodeError) as exc:
            self._fail(record, "invalid_file", f"The input file could not be read: {exc}")
            return None
        raws = [ln for ln in text.splitlines() if ln.strip()]
        lines = [parse_line(i, raw, batch["endpoint"]) for i, raw in enumerate(raws)]
        if batch["status"] == "validating":
            if not lines:
                self._fail(record, "empty_file", "The input file has no requests.")
                return None
            seen: set[str] = set()
            for line in lines:
                if line.custom_id is not None and line.custom_id in seen:
                    self._fail(record, "duplicate_custom_id", f"The custom_id {line.custom_id!r} is used more "
                               "than once (each line needs its own).", line.index + 1)
                    return None
                if line.custom_id is not None:
                    seen.add(line.custom_id)
            batch["status"], batch["in_progress_at"] = "in_progress", int(time.time())
            batch["request_counts"]["total"] = len(lines)
            self.store.save_batch(record)
        return lines

    async def _run(self, record: dict[str, Any]) -> None:
        batch = record["batch"]
        try:
            if batch["status"] in ("validating", "in_progress", "cancelling"):
                lines = self._lines(record)
                if lines is None:
                    return
                if batch["status"] in ("in_progress", "cancelling"):
                    await self._run_lines(record, lines)
            self._finalize(record)
        except (_Stopped, asyncio.CancelledError):
            logger.info("batch %s left %s, to be resumed", batch["id"], batch["status"])
        except Exception as exc:     # a bug: fail the job, keep the server
            logger.exception("batch %s failed", batch["id"])
            self._fail(record, "internal_error", f"{type(exc).__name__}: {exc}")

    async def _run_lines(self, record: dict[str, Any], lines: list[Any]) -> None:
        batch = record["batch"]
        out_path, err_path = (self.store.content_path(record[k]) for k in ("output_file", "error_file"))
        done_out, done_err = finished_ids(out_path), finished_ids(err_path)
        counts = batch["request_counts"]
        counts["completed"], counts["failed"] = sum(done_out.values()), sum(done_err.values())
        done: Counter = done_out + done_err
        out, err = AppendLog(out_path), AppendLog(err_path)
        pending: set[asyncio.Task] = set()
        stopped: list[BaseException] = []

        def write(result: dict[str, Any]) -> None:
            ok = succeeded(result)
            (out if ok else err).append(dumps_line(result))
            counts["completed" if ok else "failed"] += 1
            self.store.save_batch(record)

        async def one(line: Any) -> None:
            try:
                while True:
                    status, body = await run_line(self.app, line, self.priority)
                    if not is_transient(status, body):
                        break
                    if self.state.shutting_down or not self.state.client.is_alive:
                        raise _Stopped()
                    await asyncio.sleep(0.5)     # overloaded: try again later
                write(output_record(line, status, body))
            except _Stopped as exc:
                stopped.append(exc)
            finally:
                assert self._gate is not None
                self._gate.release()

        try:
            for line in lines:
                if batch["status"] == "cancelling" or stopped:
                    break
                if self.state.shutting_down:     # let the drain finish; resumed on the next start
                    stopped.append(_Stopped())
                    break
                if done[line.custom_id] > 0:    # finished before a restart
                    done[line.custom_id] -= 1
                    continue
                if line.error is not None:
                    write(output_record(line))
                    continue
                await self._slot()
                task = asyncio.get_running_loop().create_task(one(line))
                pending.add(task)
                task.add_done_callback(pending.discard)
            if pending:
                await asyncio.gather(*pending)
        except asyncio.CancelledError:
            for task in pending:
                task.cancel()
            raise
        finally:
            out.close()
            err.close()
        if stopped:
            raise _Stopped()

    async def _slot(self) -> None:
        """One of the `max_in_flight` batch slots, taken only while the engine's waiting queue is short."""
        assert self._gate is not None
        await self._gate.acquire()
        try:
            while self.state.client.num_waiting_estimate > self.max_waiting:
                if self.state.shutting_down:
                    raise _Stopped()
                await asyncio.sleep(0.02)
        except BaseException:
            self._gate.release()
            raise

    def _finalize(self, record: dict[str, Any]) -> None:
        batch = record["batch"]
        if batch["status"] not in ("in_progress", "finalizing", "cancelling"):
            return
        cancelled = batch["status"] == "cancelling"
        if not cancelled:
            batch["status"], batch["finalizing_at"] = "finalizing", batch["finalizing_at"] or int(time.time())
            self.store.save_batch(record)
        counts = batch["request_counts"]
        done_out = finished_ids(self.store.content_path(record["output_file"]))
        done_err = finished_ids(self.store.content_path(record["error_file"]))
        counts["completed"], counts["failed"] = sum(done_out.values()), sum(done_err.values())
        if counts["completed"] or not counts["failed"]:
            self.store.register_file(record["output_file"], f"{batch['id']}_output.jsonl", "batch_output")
            batch["output_file_id"] = record["output_file"]
        if counts["failed"]:
            self.store.register_file(record["error_file"], f"{batch['id']}_error.jsonl", "batch_output")
            batch["error_file_id"] = record["error_file"]
        now = int(time.time())
        if cancelled:
            batch["status"], batch["cancelled_at"] = "cancelled", now
        else:
            batch["status"], batch["completed_at"] = "completed", now
        self.store.save_batch(record)
        logger.info("batch %s %s: %d completed, %d failed", batch["id"], batch["status"], counts["completed"],
                    counts["failed"])
