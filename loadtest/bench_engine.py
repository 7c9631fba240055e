"""Engine benchmark against its peers, same machine, same run, rounds alternating.

Workloads (loadtest/workloads.py): W1 1 x 128, W2 32 x 128, W3 64 x 128, W4 64 requests with
outputs spread over 16..256; greedy, EOS ignored. P1 and P4 (one 1024- or 4096-token prompt, 16 new tokens) are
reported in prompt tokens a second: the prompt over the time to its first token. Peers: HF `generate` (static left-padded
batch, same dtype; a static batch runs to its longest request, only requested tokens count)
and llama.cpp's `llama-server` on the model's GGUF (loadtest/llamacpp_peer.py). Each
(implementation, dtype) runs in its own process so peak RSS is its own; with `--rounds N`
the implementations alternate N times and the medians are reported (this machine is noisy).

    mini-infer bench engine [--dtypes float32,bfloat16] [--workloads W1,W2,W3,W4,P1,P4]
        [--compare hf,llamacpp,llamacpp-stream,llamacpp-ngram] [--rounds 3] [--compile off]
        [--out r.json] [--plot r.png]
    mini-infer bench engine --profile [--dtypes bfloat16] [--quantization int4]

`--plot` draws throughput against concurrency (the uniform workloads: 1, 8, 32, 64 requests).
`--profile` prints where the wall-clock time of a W1 and a W2 decode step goes: GEMV/GEMM,
attention, other operators, Python in the forward, and each part outside it
(loadtest/profile_step.py).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import queue
import resource
import statistics
import sys
import threading
import time
from pathlib import Path

from loadtest.llamacpp_peer import (
    ENV_VAR,
    NGRAM_ARGS,
    find_server,
    missing_message,
    run_llamacpp,
)
from loadtest.report import decode_speed, emit, summarize, token_gaps
from loadtest.workloads import CONCURRENCY, ENGINE_OPTIONS, workload_prompts, workloads

# peer name -> result key; "llamacpp" (non-streaming) is the main line the ratios use;
# "llamacpp-ngram" the same with llama-server's n-gram speculation (llamacpp_peer.NGRAM_ARGS).
LLAMACPP_PEERS = {"llamacpp": "llamacpp-gguf", "llamacpp-stream": "llamacpp-gguf-stream",
                  "llamacpp-ngram": "llamacpp-gguf-ngram"}  # fmt: skip


def run_engine(
    model: str,
    dtype: str,
    prompts: list[list[int]],
    max_tokens: int | list[int],
    with_token_gaps: bool = False,
    sampling: dict | None = None,
    **options,
) -> dict:
    """One workload on `LLMEngine` (ENGINE_OPTIONS, overridden by `options`); `max_tokens`
    per request or one for all. `with_token_gaps`: also the gaps between each request's
    tokens as the steps returned them (report.token_gaps). `sampling`: SamplingParams fields
    (e.g. temperature, top_p) instead of greedy, request i seeded i.

    Start-up is reported apart from throughput: `load_s` (weights, packing, KV pool: the
    engine's construction less its compilation), `compile_s` (torch.compile's graphs, at
    start-up and in the warm-up request), and `compile_in_run_s` (graphs compiled during the
    measured run: a recompile in steady state; subtracted from the run's time, so
    `tokens_per_s` is steady-state throughput and `tokens_per_s_with_compile` what a client
    saw). Later workloads in the same child process reuse the first one's graphs (dynamo's
    in-process cache), so their compile_s is near 0."""
    from engine import LLMEngine, SamplingParams

    if isinstance(max_tokens, int):
        max_tokens = [max_tokens] * len(prompts)
    start = time.perf_counter()
    eng = LLMEngine(model, dtype=dtype, **{**ENGINE_OPTIONS, **options})
    construct_s = time.perf_counter() - start
    compiled = getattr(eng.runner, "_forward", None)

    def compile_s() -> float:  # CompiledModel counts the time of every graph it compiles
        return getattr(compiled, "compile_s", 0.0)

    startup_compile_s = compile_s()
    # The warm-up's prompt is the first one backwards: as long, sharing no block with it, so the
    # measured prompts find nothing of theirs in the prefix cache (the peers cache nothing).
    eng.add_request("warmup", prompts[0][::-1], SamplingParams(max_tokens=4, temperature=0.0))
    while eng.has_unfinished_requests():
        eng.step()
    warm_compile_s = compile_s()
    drafted0, accepted0 = _draft_counts(eng)
    start = time.perf_counter()
    first: dict[str, float] = {}
    arrivals: dict[str, list[float]] = {}  # per request, when each token came out of a step
    num_tokens = 0
    for i, (p, n) in enumerate(zip(prompts, max_tokens, strict=True)):
        params = (
            SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
            if sampling is None
            else SamplingParams(max_tokens=n, ignore_eos=True, seed=i, **sampling)
        )
        eng.add_request(str(i), p, params)
    while eng.has_unfinished_requests():
        for d in eng.step():
            now = time.perf_counter()
            num_tokens += len(d.token_ids)
            first.setdefault(d.request_id, now - start)
            arrivals.setdefault(d.request_id, []).extend([now] * len(d.token_ids))
    elapsed = time.perf_counter() - start
    in_run_s = compile_s() - warm_compile_s
    result = summarize(num_tokens, elapsed - in_run_s, [t - in_run_s for t in first.values()])
    result.update(
        load_s=round(construct_s - startup_compile_s, 2), compile_s=round(warm_compile_s, 2),
        compile_in_run_s=round(in_run_s, 2),
        num_graphs=getattr(compiled, "num_compiles", 0),
        tokens_per_s_with_compile=round(num_tokens / elapsed, 1),
    )  # fmt: skip
    drafted, accepted = _draft_counts(eng)
    if drafted > drafted0:  # speculative decoding ran: how many drafts the verification kept
        result.update(draft_tokens=drafted - drafted0, draft_accepted=accepted - accepted0)
    if with_token_gaps:
        result["token_gaps"] = token_gaps(list(arrivals.values()))
    return result


def _draft_counts(eng) -> tuple[int, int]:
    stats = eng.get_stats()
    return stats.num_draft_tokens, stats.num_draft_accepted


def _hf_model(auto_class, model_path: Path, torch_dtype):
    """HF's model for the checkpoint; where the directory holds no weights of HF's own (the
    default model keeps only its GGUF), transformers reads the GGUF (dequantized to torch_dtype:
    the same values the engine's int4 path starts from)."""
    from engine.loader import gguf_source

    has_weights = any(model_path.glob("*.safetensors")) or any(model_path.glob("*.bin"))
    gguf = None if has_weights else gguf_source(model_path)
    if gguf is None:
        return auto_class.from_pretrained(model_path, dtype=torch_dtype).eval()
    return auto_class.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch_dtype).eval()


def run_hf(
    model_path: str, dtype: str, prompts: list[list[int]], max_tokens: int | list[int]
) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, StoppingCriteria, StoppingCriteriaList

    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    load_start = time.perf_counter()
    model = _hf_model(AutoModelForCausalLM, Path(model_path), torch_dtype)
    load_s = time.perf_counter() - load_start
    pad = model.generation_config.pad_token_id or 0

    class FirstToken(StoppingCriteria):
        """Records when the first new token of the batch exists (called after each step)."""

        def __init__(self, start: float):
            self.start, self.at = start, None

        def __call__(self, input_ids, scores, **kwargs):
            if self.at is None:
                self.at = time.perf_counter() - self.start
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    def generate(batch: list[list[int]], n: int) -> tuple[int, float, float]:
        width = max(len(p) for p in batch)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        start = time.perf_counter()
        crit = FirstToken(start)
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                pad_token_id=pad,
                stopping_criteria=StoppingCriteriaList([crit]),
            )
        elapsed = time.perf_counter() - start
        return (out.shape[1] - width) * len(batch), elapsed, crit.at

    generate(prompts[:1], 4)  # warm-up
    lengths = [max_tokens] * len(prompts) if isinstance(max_tokens, int) else max_tokens
    _, elapsed, ttft = generate(prompts, max(lengths))
    num_tokens = sum(lengths)  # a static batch runs to its longest request; count what was asked
    # A static batch delivers every request's first token at the same moment.
    return {**summarize(num_tokens, elapsed, [ttft] * len(prompts)), "load_s": round(load_s, 2)}


def _child(impl: str, spec: dict, q) -> None:
    import torch

    from engine.loader import load_tokenizer

    torch.manual_seed(0)
    if spec.get("busy_thread"):
        threading.Thread(target=_busy_loop, daemon=True).start()
    results = {}
    for name, workload in workloads(spec["max_tokens"]).items():
        if name not in spec["workloads"]:
            continue
        prompts = workload_prompts(load_tokenizer(Path(spec["model_path"])), workload)
        lengths = list(workload.max_tokens)
        try:  # one workload that fails (a peer's server refusing 64 slots) keeps the others
            if impl == "engine":
                options = {"compile": spec["compile"], "quantization": spec["quantization"],
                           "fused_ops": spec.get("fused_ops", "auto"),
                           "fused_decode": spec.get("fused_decode", "auto"),
                           "speculative_decoding": spec.get("speculative_decoding", "auto"),
                           "linear_kernel": spec.get("linear_kernel", "auto")}  # fmt: skip
                results[name] = run_engine(spec["model"], spec["dtype"], prompts, lengths,
                                           **options)  # fmt: skip
            elif impl == "hf":
                results[name] = run_hf(spec["model_path"], spec["dtype"], prompts, lengths)
            else:  # "llamacpp" (non-streaming, the main line), "-stream" or "-ngram"
                extra = NGRAM_ARGS if impl.endswith("-ngram") else ()
                results[name] = run_llamacpp(Path(spec["llama_server"]), Path(spec["gguf"]),
                                             prompts, lengths, impl.endswith("-stream"),
                                             extra)  # fmt: skip
        except Exception as error:
            print(f"[bench] {impl} {name} failed: {error!r}", file=sys.stderr, flush=True)
            results[name] = {"error": repr(error)[-500:]}
        else:
            results[name].update(prefill_speed(prompts, results[name]))
    peak_rss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    q.put({"results": results, "peak_rss_mib": round(peak_rss_mib, 1),
           "threads": torch.get_num_threads()})  # fmt: skip


def prefill_speed(prompts: list[list[int]], result: dict) -> dict:
    """The prompts' tokens over the time to the last request's first token: prefill's speed as
    a client sees it (every prompt is in the KV cache by then)."""
    num_tokens = sum(len(p) for p in prompts)
    last_ttft_s = max(result["ttfts_ms"]) / 1000
    return {"prompt_tokens": num_tokens,
            "prompt_tokens_per_s": round(num_tokens / last_ttft_s, 1) if last_ttft_s else None}  # fmt: skip


def _busy_loop() -> None:
    """A competitor in the engine's process, shaped like the worker's event loop: 1 ms of
    Python work (holding the GIL and a core), 1 ms asleep, forever (a daemon thread)."""
    while True:
        until = time.perf_counter() + 0.001
        while time.perf_counter() < until:
            pass
        time.sleep(0.001)


def measure(impl: str, spec: dict) -> dict:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    proc = ctx.Process(target=_child, args=(impl, spec, q))
    proc.start()
    while True:  # a child that dies (a peer that fails to start) must not hang the bench
        try:
            out = q.get(timeout=5)
            break
        except queue.Empty:
            if not proc.is_alive():
                raise RuntimeError(f"bench child for {impl} exited with {proc.exitcode}") from None
    proc.join()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="mini-infer bench engine", description=__doc__.split("\n\n")[0]
    )
    add_arguments(parser)
    return run(parser.parse_args(argv))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--workloads", default="W1,W2", help="comma list of W1,W2,W3,W4,C8,P1,P4")
    parser.add_argument(
        "--compare", default="hf",
        help="peers: comma list of hf,llamacpp,llamacpp-stream,llamacpp-ngram",
    )
    parser.add_argument("--rounds", type=int, default=1, help="alternating rounds (medians)")
    parser.add_argument("--compile", default="auto", help="engine compile: auto|on|off")
    parser.add_argument(
        "--quantization", default=None,
        help="engine weights: int8 | int4 | w8a8 (use bf16), a kernel suffix (int4@exact), "
        "or a comma list to alternate (int4,int4@exact)"
    )
    parser.add_argument(
        "--fused-ops", default="auto", help="engine CPU elementwise ops: auto|on|off"
    )
    parser.add_argument(
        "--fused-decode", default="auto",
        help="engine fused decode step: auto|on|off, or a comma list to alternate (e.g. on,off)",
    )  # fmt: skip
    parser.add_argument(
        "--speculative-decoding", default="auto",
        help="engine speculative decoding: auto|on|off, or a comma list to alternate (on,off)",
    )  # fmt: skip
    parser.add_argument(
        "--linear-kernel", default="auto", help="engine bf16 linears: auto|plain|packed|gemv"
    )
    parser.add_argument("--llama-server", default=None, help=f"llama-server binary ({ENV_VAR})")
    parser.add_argument("--gguf", type=Path, default=None, help="GGUF for llama.cpp")
    parser.add_argument("--profile", action="store_true", help="profile decode steps instead")
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    parser.add_argument("--plot", type=Path, default=None, help="throughput vs concurrency PNG")


def _default_gguf() -> Path | None:
    from engine.loader import DEFAULT_MODEL_ALIAS, DEFAULT_MODEL_GGUF, cache_dir

    path = cache_dir() / "models" / DEFAULT_MODEL_ALIAS / DEFAULT_MODEL_GGUF
    return path if path.is_file() else None


def run(args) -> int:
    from engine.loader import resolve_model

    if args.profile:
        from loadtest.profile_step import profile

        names = tuple(w for w in args.workloads.split(",") if w in ("W1", "W2"))
        return profile(args.model, args.dtypes.split(",")[0], args.quantization,
                       names or ("W1", "W2"), args.compile, args.out,
                       fused_ops=args.fused_ops,
                       fused_decode=args.fused_decode.split(",")[0])  # fmt: skip
    model_path = str(resolve_model(args.model))
    peers = [p for p in args.compare.split(",") if p]
    unknown = set(peers) - {"hf", *LLAMACPP_PEERS}
    if unknown:
        raise SystemExit(f"unknown peer(s) {sorted(unknown)}; use hf, {', '.join(LLAMACPP_PEERS)}")
    server, gguf = find_server(args.llama_server), args.gguf or _default_gguf()
    if set(peers) & set(LLAMACPP_PEERS) and (server is None or gguf is None):
        print(missing_message() if server is None else "llama.cpp peer skipped: no GGUF "
              "(pass --gguf)", file=sys.stderr)  # fmt: skip
        peers = [p for p in peers if p not in LLAMACPP_PEERS]
    names = args.workloads.split(",")
    # `import engine` (above) set the OpenMP wait policy in this environment: the engine and HF
    # children run under it; llama-server gets the environment from before (llamacpp_peer.py).
    doc = {"model": args.model, "max_tokens": args.max_tokens, "rounds": args.rounds,
           "workloads": names, "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
           "runs": {}, "medians": {}}  # fmt: skip
    for dtype in args.dtypes.split(","):
        spec = {"model": args.model, "model_path": model_path, "dtype": dtype,
                "max_tokens": args.max_tokens, "workloads": names, "compile": args.compile,
                "quantization": args.quantization, "fused_ops": args.fused_ops,
                "linear_kernel": args.linear_kernel,
                "llama_server": str(server), "gguf": str(gguf)}  # fmt: skip
        # llama.cpp runs its own quantised GGUF: one run per round whatever the dtype list.
        first_dtype = dtype == args.dtypes.split(",")[0]
        # Engine sides, alternated with the peers: each quantization x each fused-decode value
        # x each speculative-decoding value.
        variants = args.fused_decode.split(",")
        speculations = args.speculative_decoding.split(",")
        quants = (args.quantization or "").split(",")
        impls = [*(("engine", q, v, s) for q in quants for v in variants for s in speculations),
                 *((p, "", "", "") for p in peers if p not in LLAMACPP_PEERS or first_dtype)]  # fmt: skip
        for round_index in range(args.rounds):
            for impl, quant, variant, speculation in impls:
                key = LLAMACPP_PEERS.get(impl, f"{impl}-{dtype}")
                if impl == "engine" and quant:
                    key += f"-{quant}"
                if impl == "engine" and args.linear_kernel != "auto":
                    key += f"-{args.linear_kernel}"
                if impl == "engine" and len(variants) > 1:
                    key += f"-fused-{variant}"
                if impl == "engine" and len(speculations) > 1:
                    key += f"-spec-{speculation}"
                print(f"[bench] round {round_index + 1}: {key} ...", file=sys.stderr, flush=True)
                side = {**spec, "fused_decode": variant or "auto", "quantization": quant or None,
                        "speculative_decoding": speculation or "auto"}  # fmt: skip
                try:
                    result = measure(impl, side)
                except RuntimeError as error:  # a child that died: the other runs stand
                    print(f"[bench] {key} failed: {error}", file=sys.stderr, flush=True)
                    doc.setdefault("errors", []).append(f"round {round_index + 1} {key}: {error}")
                else:
                    doc["runs"].setdefault(key, []).append(result)
                if args.out:  # a long run interrupted late still leaves its rounds behind
                    args.out.write_text(json.dumps(doc, indent=2))
    for key, runs in doc["runs"].items():
        doc["medians"][key] = _medians(runs, names)
    doc["ratios"] = _ratios(doc["medians"])
    doc["startup_s"] = _startup(doc["runs"])
    prefill = [w for w in names if speed_of(w) != "tokens_per_s"]
    print(f"{'impl':22} " + " ".join(f"{w:>9}" for w in names) + "   (output tok/s, medians"
          + (f"; {','.join(prefill)}: prompt tok/s to the first token)" if prefill else ")"))  # fmt: skip
    for key, med in doc["medians"].items():
        print(f"{key:22} " + " ".join(f"{med.get(w, float('nan')):9.1f}" for w in names))
    for key, runs in doc["runs"].items():  # llama.cpp's own decode speed beside wall-clock
        if key in LLAMACPP_PEERS.values():
            cells = (f"{w}={_server_speed(runs, w)}" for w in names if w not in prefill)
            print(f"{key:22} server timings.predicted_per_second (median request; sum): "
                  + " ".join(cells))  # fmt: skip
            if prefill:
                cells = (f"{w}={_server_speed(runs, w, 'server_prompt_tok_s')}" for w in prefill)
                print(f"{key:22} server timings.prompt_per_second (median request; sum): "
                      + " ".join(cells))  # fmt: skip
    for pair, ratios in doc["ratios"].items():
        print(f"{pair:34} " + " ".join(f"{w}={r:.2f}" for w, r in ratios.items()))
    doc["decode_medians"], doc["decode_ratios"] = _decode_medians(doc["runs"], names)
    if doc["decode_ratios"]:  # one request: decode alone, llama.cpp's by its own clock
        print("decode tok/s after the first token (medians; llama.cpp: its own timings): "
              + ", ".join(f"{k} {w}={v}" for k, m in doc["decode_medians"].items()
                          for w, v in m.items()))  # fmt: skip
        for pair, ratios in doc["decode_ratios"].items():
            print(f"{pair + ' (decode)':34} " + " ".join(f"{w}={r:.2f}" for w, r in ratios.items()))
    if doc["startup_s"]:
        print("start-up, s (medians; load = weights, packing, KV pool; compile = torch.compile "
              "graphs, excluded from tok/s):")  # fmt: skip
        for key, per_workload in doc["startup_s"].items():
            compiles = key.startswith("engine")  # the peers compile nothing
            cells = (f"{w}: load {v['load_s']:.1f}" + (f" compile {v['compile_s']:.1f}"
                     if compiles else "") for w, v in per_workload.items())  # fmt: skip
            print(f"  {key:20} " + "; ".join(cells))
    emit(doc, args.out, args.plot, lambda plt: _draw(doc, plt))
    return 0


def speed_of(workload: str) -> str:
    """The result field a workload is compared by: output tok/s, or for a prefill workload
    (P1) prompt tok/s."""
    return "prompt_tokens_per_s" if workloads()[workload].prompt_tokens else "tokens_per_s"


def _medians(runs: list[dict], names: list[str]) -> dict:
    """tok/s medians per workload over the rounds where that workload ran (not failed): output
    tokens, or the prompt's for a prefill workload (`speed_of`)."""
    out = {}
    for w in names:
        field = speed_of(w)
        values = [r["results"][w][field] for r in runs
                  if r["results"].get(w, {}).get(field)]  # fmt: skip
        if values:
            out[w] = round(statistics.median(values), 1)
    return out


def _decode_medians(runs: dict, names: list[str]) -> tuple[dict, dict]:
    """For one-request workloads, each side's decode speed (report.decode_speed: the tokens
    after the first; llama-server's own clock), medians over rounds, and engine / llama.cpp.
    The wall-clock ratios count each side's prefill too: llama.cpp's Q4_1 prefill is slow
    beside ours on these CPUs, so they alone would flatter the engine."""
    medians: dict = {}
    for key, rounds in runs.items():
        for w in (w for w in names if speed_of(w) == "tokens_per_s"):  # not prefill's
            speeds = [d for r in rounds if (d := decode_speed(r["results"].get(w) or {}))]
            if speeds and all(len((r["results"].get(w) or {}).get("ttfts_ms", [])) == 1
                              for r in rounds):  # fmt: skip
                medians.setdefault(key, {})[w] = round(statistics.median(speeds), 1)
    ratios = _ratios(medians, peers=tuple(LLAMACPP_PEERS.values()))
    return medians, {pair: by_workload for pair, by_workload in ratios.items() if by_workload}


def _server_speed(runs: list[dict], w: str, field: str = "server_tok_s") -> str:
    """llama-server's own tok/s for workload `w` (its decode's, or `field`), medians over
    rounds: "median request; sum"."""
    speeds = [r["results"][w][field] for r in runs
              if (r["results"].get(w) or {}).get(field)]  # fmt: skip
    if not speeds:
        return "n/a"
    median = statistics.median(s["median"] for s in speeds)
    return f"{median:.1f};{statistics.median(s['sum'] for s in speeds):.1f}"


def _startup(runs: dict) -> dict:
    """Medians over rounds of each workload's load and compile time, where they were taken."""
    out = {}
    for key, key_runs in runs.items():
        per_workload = {}
        for w in key_runs[0]["results"]:
            timed = [r["results"][w] for r in key_runs if "load_s" in r["results"].get(w, {})]
            if timed:
                per_workload[w] = {
                    field: round(statistics.median(t.get(field, 0.0) for t in timed), 2)
                    for field in ("load_s", "compile_s", "compile_in_run_s")
                }
        if per_workload:
            out[key] = per_workload
    return out


def _ratios(medians: dict, peers: tuple[str, ...] | None = None) -> dict:
    """engine / peer per workload: against HF in the same dtype, and against llama.cpp (its own
    quantised GGUF) for every engine dtype; or against `peers` for every engine dtype."""
    out = {}
    for engine_key in (k for k in medians if k.startswith("engine-")):
        dtype = engine_key.removeprefix("engine-").split("-")[0]  # engine-<dtype>[-<quant>]
        against = (f"hf-{dtype}", "llamacpp-gguf", "llamacpp-gguf-ngram") if peers is None else peers
        for peer_key in (k for k in medians if k in against):
            shared = set(medians[engine_key]) & set(medians[peer_key])
            out[f"{engine_key}/{peer_key}"] = {
                w: round(medians[engine_key][w] / medians[peer_key][w], 2) for w in sorted(shared)
            }
    return out


def _draw(doc: dict, plt):
    """Throughput against concurrency for the uniform-length workloads."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for key, med in doc["medians"].items():
        points = sorted((CONCURRENCY[w], tps) for w, tps in med.items() if w in CONCURRENCY)
        if points:
            ax.plot(*zip(*points, strict=True), marker="o", label=key)
    ax.set_xscale("log", base=2)
    ticks = sorted(set(CONCURRENCY.values()))
    ax.set_xticks(ticks, [str(t) for t in ticks])
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("output tokens/s (median of rounds)")
    ax.set_title(f"throughput vs concurrency ({doc['max_tokens']} new tokens per request)")
    ax.legend()
    return fig


if __name__ == "__main__":
    sys.exit(main())
