"""The llama.cpp peer against a stand-in `llama-server` (a small HTTP server in Python): the
environment it is started with, and both request modes, with the server's own timings."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

FAKE_SERVER = r"""
import json, os, sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

args = sys.argv[1:]
port = int(args[args.index("--port") + 1])
with open(os.environ["FAKE_ENV_OUT"], "w") as f:
    json.dump({"env": dict(os.environ), "args": args}, f)
TIMINGS = {"predicted_ms": 100.0, "predicted_n": 8, "predicted_per_second": 80.0,
           "prompt_per_second": 500.0}
if "--spec-type" in args:  # speculating: llama-server reports its drafts
    TIMINGS.update(draft_n=6, draft_n_accepted=4)

class Handler(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass

    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b"{}")

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        n = body["n_predict"]
        if os.environ.get("FAKE_FAIL") and body["prompt"] == [3]:
            self.send_response(500); self.end_headers(); self.wfile.write(b"no slot")
            return
        self.send_response(200); self.end_headers()
        if not body["stream"]:
            answer = {"content": "x" * n, "tokens_predicted": n, "timings": TIMINGS}
            self.wfile.write(json.dumps(answer).encode())
            return
        for i in range(n):
            event = {"content": "x", "tokens": [i], "stop": False}
            self.wfile.write(b"data: " + json.dumps(event).encode() + b"\n\n")
        last = {"content": "", "stop": True, "timings": TIMINGS}
        self.wfile.write(b"data: " + json.dumps(last).encode() + b"\n\n")

ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()
"""


@pytest.fixture
def fake_server(tmp_path: Path) -> Path:
    binary = tmp_path / "llama-server"
    binary.write_text(f"#!{sys.executable}\n{FAKE_SERVER}")
    binary.chmod(binary.stat().st_mode | stat.S_IEXEC)
    return binary


def _run_peer(
    binary: Path, tmp_path: Path, stream: bool, env: dict[str, str], extra: tuple = ()
) -> tuple[dict, dict]:
    """The peer in a fresh interpreter that imports engine first, as the bench's children do."""
    out = tmp_path / "env.json"
    code = (
        "import json, sys, engine; from pathlib import Path; "
        "from loadtest.llamacpp_peer import run_llamacpp; "
        f"r = run_llamacpp(Path({str(binary)!r}), Path('m.gguf'), [[1, 2], [3]], [5, 7], {stream}, "
        f"{extra!r}); print(json.dumps(r))"
    )
    base = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "MINI_INFER_OMP"))}
    result = subprocess.run(
        [sys.executable, "-c", code], env={**base, **env, "FAKE_ENV_OUT": str(out)},
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    return json.loads(result.stdout.strip().splitlines()[-1]), json.loads(out.read_text())


@pytest.mark.parametrize("stream", [False, True])
def test_peer_runs_without_the_engines_openmp_policy(fake_server, tmp_path, stream):
    result, seen = _run_peer(fake_server, tmp_path, stream, {})
    assert "OMP_WAIT_POLICY" not in seen["env"]  # engine set it in the client, not for the peer
    assert not any(k.startswith("MINI_INFER_OMP") for k in seen["env"])
    assert seen["args"][seen["args"].index("-t") + 1] == "2"
    assert seen["args"][seen["args"].index("-tb") + 1] == "2"
    assert result["output_tokens"] == 12 and result["stream"] is stream
    assert result["server_tok_s"] == {"median": 80.0, "sum": 160.0}
    assert result["server_prompt_tok_s"] == {"median": 500.0, "sum": 1000.0}  # both modes


def test_the_ngram_line_passes_its_speculation_and_reports_the_drafts(fake_server, tmp_path):
    from loadtest.llamacpp_peer import NGRAM_ARGS

    result, seen = _run_peer(fake_server, tmp_path, False, {}, NGRAM_ARGS)
    assert seen["args"][-len(NGRAM_ARGS):] == list(NGRAM_ARGS)
    assert result["draft_tokens"] == 12 and result["draft_accepted"] == 8  # two requests
    plain, _ = _run_peer(fake_server, tmp_path, False, {})
    assert "draft_tokens" not in plain


def test_peer_keeps_a_policy_the_user_set(fake_server, tmp_path):
    _, seen = _run_peer(fake_server, tmp_path, False, {"OMP_WAIT_POLICY": "ACTIVE"})
    assert seen["env"]["OMP_WAIT_POLICY"] == "ACTIVE"


def test_a_failed_request_is_a_clear_error_not_a_missing_key(fake_server, tmp_path):
    """A request the server answers with an error (here: not JSON) fails the run and says so,
    instead of leaving an empty result behind for a KeyError later."""
    with pytest.raises(subprocess.CalledProcessError) as failure:
        _run_peer(fake_server, tmp_path, False, {"FAKE_FAIL": "1"})
    assert "1 of 2 llama-server requests failed" in failure.value.stderr
    assert "KeyError" not in failure.value.stderr
