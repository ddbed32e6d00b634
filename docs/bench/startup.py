"""Start-up to first token served: launch `tokenmill serve`, send one completion request as soon
as the port accepts it (retrying while the model loads), stop the clock at the first streamed
token. Warm caches (native kernels built, files in the page cache): one untimed run first.

    python docs/bench/startup.py [--repeat 3] [-- extra serve flags, e.g. --quantization int4]
"""
from __future__ import annotations

import argparse
import json
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_run(serve_args: list[str]) -> float:
    port = _free_port()
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "tokenmill.entrypoints.cli", "serve", "--port", str(port),
                             *serve_args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"serve exited with {proc.returncode}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=60) as resp:
                    model = json.load(resp)["data"][0]["id"]
                body = json.dumps({"model": model, "prompt": "Hello", "max_tokens": 1, "stream": True}).encode()
                req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                             headers={"Content-Type": "application/json"})
                with urllib.request.urlopen(req, timeout=60) as resp:
                    for line in resp:
                        if line.startswith(b"data: {"):
                            return time.perf_counter() - start
            except (urllib.error.URLError, ConnectionError, OSError):
                time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=3)
    args, serve_args = parser.parse_known_args()
    serve_args = [a for a in serve_args if a != "--"]
    one_run(serve_args)                                    # warm: kernels built, files cached
    times = [one_run(serve_args) for _ in range(args.repeat)]
    print(f"start-up to first token served ({' '.join(serve_args) or 'defaults'}): "
          f"median {statistics.median(times):.2f} s, runs {', '.join(f'{t:.2f}' for t in times)}")


if __name__ == "__main__":
    main()
