"""Engine benchmark against Hugging Face transformers, same machine, same run.

W1: one request, 128 new tokens. W2: 32 distinct chat prompts submitted together, 128 new
tokens each, greedy, EOS ignored. The baseline is HF `generate` with a static left-padded batch
in the same dtype. Each (implementation, dtype) runs in its own process so peak RSS is its own.

    mini-infer bench engine [--dtypes float32,bfloat16] [--max-tokens 128] [--out results.json]

Prints a table and a JSON document; the ratios (engine / HF) are the numbers to read, since
absolute speed depends on the machine.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import resource
import sys
import time
from pathlib import Path

from loadtest.report import emit, summarize
from loadtest.workloads import ENGINE_OPTIONS, chat_prompts


def run_engine(
    model: str, dtype: str, prompts: list[list[int]], max_tokens: int, **options
) -> dict:
    """W1/W2 on `LLMEngine` (ENGINE_OPTIONS, overridden by `options`)."""
    from engine import LLMEngine, SamplingParams

    eng = LLMEngine(model, dtype=dtype, **{**ENGINE_OPTIONS, **options})
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    eng.add_request("warmup", prompts[0], SamplingParams(max_tokens=4, temperature=0.0))
    while eng.has_unfinished_requests():
        eng.step()
    start = time.perf_counter()
    first: dict[str, float] = {}
    num_tokens = 0
    for i, p in enumerate(prompts):
        eng.add_request(str(i), p, params)
    while eng.has_unfinished_requests():
        for d in eng.step():
            num_tokens += len(d.token_ids)
            first.setdefault(d.request_id, time.perf_counter() - start)
    elapsed = time.perf_counter() - start
    return summarize(num_tokens, elapsed, list(first.values()))


def run_hf(model_path: str, dtype: str, prompts: list[list[int]], max_tokens: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, StoppingCriteria, StoppingCriteriaList

    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch_dtype).eval()
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
    num_tokens, elapsed, ttft = generate(prompts, max_tokens)
    # A static batch delivers every request's first token at the same moment.
    return summarize(num_tokens, elapsed, [ttft] * len(prompts))


def _child(impl: str, model: str, model_path: str, dtype: str, max_tokens: int, n: int, q) -> None:
    import torch

    from engine.loader import load_tokenizer

    torch.manual_seed(0)
    prompts = chat_prompts(load_tokenizer(Path(model_path)), 32)
    results = {}
    for name, batch in (("W1", prompts[:1]), ("W2", prompts[:n])):
        if impl == "engine":
            results[name] = run_engine(model, dtype, batch, max_tokens)
        else:
            results[name] = run_hf(model_path, dtype, batch, max_tokens)
    peak_rss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    q.put(
        {
            "results": results,
            "peak_rss_mib": round(peak_rss_mib, 1),
            "threads": torch.get_num_threads(),
        }
    )


def measure(impl: str, model: str, model_path: str, dtype: str, max_tokens: int, n: int) -> dict:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    proc = ctx.Process(target=_child, args=(impl, model, model_path, dtype, max_tokens, n, q))
    proc.start()
    out = q.get()
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
    parser.add_argument("--num-prompts", type=int, default=32, help="W2 batch size")
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    parser.add_argument("--plot", type=Path, default=None, help="write a bar chart (PNG) here")


def run(args) -> int:
    from engine.loader import resolve_model

    model_path = str(resolve_model(args.model))
    rows, doc = [], {"model": args.model, "max_tokens": args.max_tokens, "runs": {}}
    for dtype in args.dtypes.split(","):
        for impl in ("hf", "engine"):
            print(f"[bench] {impl} {dtype} ...", file=sys.stderr, flush=True)
            doc["runs"][f"{impl}-{dtype}"] = r = measure(
                impl, args.model, model_path, dtype, args.max_tokens, args.num_prompts
            )
            for w, s in r["results"].items():
                rows.append((impl, dtype, w, s, r["peak_rss_mib"]))
        for w in ("W1", "W2"):
            e = doc["runs"][f"engine-{dtype}"]["results"][w]["tokens_per_s"]
            h = doc["runs"][f"hf-{dtype}"]["results"][w]["tokens_per_s"]
            doc.setdefault("speedup_vs_hf", {})[f"{w}-{dtype}"] = round(e / h, 2)
    print(
        f"{'impl':8} {'dtype':9} {'wl':3} {'tok/s':>8} {'ttft p50':>9} {'ttft p99':>9} {'peak RSS':>9}"
    )
    for impl, dtype, w, s, rss in rows:
        print(
            f"{impl:8} {dtype:9} {w:3} {s['tokens_per_s']:8.1f} {s['ttft_p50_ms']:8.1f}ms "
            f"{s['ttft_p99_ms']:8.1f}ms {rss:7.0f}MiB"
        )
    print("speedup engine/hf:", doc["speedup_vs_hf"])
    emit(doc, args.out, args.plot, lambda plt: _draw(doc, plt))
    return 0


def _draw(doc: dict, plt):
    names = list(doc["runs"])
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, w in zip(axes, ("W1", "W2"), strict=True):
        vals = [doc["runs"][n]["results"][w]["tokens_per_s"] for n in names]
        ax.bar(names, vals, color=["#999" if n.startswith("hf") else "#2a7" for n in names])
        ax.set_title(f"{w}: output tokens/s (higher is better)")
        ax.tick_params(axis="x", rotation=30)
    return fig


if __name__ == "__main__":
    sys.exit(main())
