"""One prepared check of the CUDA path on a GPU machine; one JSON line per result.

    python loadtest/gpu_check.py [--model DIR] [--budget-s 270]
    TRITON_INTERPRET=1 python loadtest/gpu_check.py --dry-run   # CPU, tiny sizes

In order, each section skipped once the time budget is spent (the whole run must fit in five
minutes of a lent GPU):
1. every Triton kernel against its torch reference (fp32 and bf16);
2. device-to-device copy bandwidth, then decode attention at contexts 512..32k: median time
   (CUDA events, warm-up first) and achieved read bandwidth as a fraction of the copy's;
3. prefill: the Triton paged kernel against SDPA (FlashAttention) on a contiguous chunk;
4. the whole decode step (SmolLM2 shape, bf16), eager against CUDA-graph replay;
5. W1 (1 request) and W2 (32 requests), 128 greedy tokens each, on the engine (bf16, CUDA
   graphs on and off, then the int8 KV cache under graphs) against Hugging Face `generate`
   (static batch, bf16) on the same GPU.

The model: `--model DIR` is a Hugging Face checkpoint directory; one without weights gets
random weights of its config's shapes (throughput does not depend on the values), one
without a tokenizer gets random prompt ids of the chat prompts' lengths. By default the
converted default model in the local cache is used if present, else SmolLM2-135M's config
built in here with random weights, so nothing has to be downloaded on the GPU machine.

The GPU machine may lack the engine's logging and cache-path libraries (structlog,
platformdirs); `install_missing_module_shims` puts minimal stand-ins into sys.modules for
whichever is missing, before the engine is imported.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import math
import os
import statistics
import sys
import tempfile
import time
import types
from pathlib import Path

# SmolLM2-135M-Instruct's architecture (the default model), for random weights of its shape.
SMOLLM2_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
    "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
    "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
    "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "vocab_size": 49152,
    "rope_parameters": {"rope_theta": 100000.0, "rope_type": "default"},
    "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2,
}  # fmt: skip
CHAT_PROMPT_LENGTHS = (31, 47)  # token lengths of the W2 chat prompts with SmolLM2's tokenizer


def install_missing_module_shims() -> list[str]:
    """Minimal stand-ins for structlog and platformdirs where they are not installed; returns
    the names shimmed. Logging goes to stderr as one JSON object per event."""
    shimmed = []
    if importlib.util.find_spec("structlog") is None:

        class _Logger:
            def _emit(self, level, event, **kw):
                record = {"level": level, "event": event, **kw}
                print(json.dumps(record, default=str), file=sys.stderr)

            def __getattr__(self, level):
                return functools.partial(self._emit, level)

        shim = types.ModuleType("structlog")
        shim.get_logger = lambda *args, **kwargs: _Logger()
        sys.modules["structlog"] = shim
        shimmed.append("structlog")
    if importlib.util.find_spec("platformdirs") is None:
        shim = types.ModuleType("platformdirs")
        shim.user_cache_dir = lambda name, *args, **kwargs: str(Path.home() / ".cache" / name)
        sys.modules["platformdirs"] = shim
        shimmed.append("platformdirs")
    return shimmed


class Check:
    """Prints results as JSON lines and keeps the time budget."""

    def __init__(self, budget_s: float, device):
        self.start = time.perf_counter()
        self.budget_s = budget_s
        self.device = device
        self.num_failed = 0

    def emit(self, check: str, **fields) -> None:
        fields = {k: round(v, 4) if isinstance(v, float) else v for k, v in fields.items()}
        print(json.dumps({"check": check, **fields}), flush=True)
        if fields.get("ok") is False:
            self.num_failed += 1

    def time_left(self) -> float:
        return self.budget_s - (time.perf_counter() - self.start)

    def out_of_time(self, section: str) -> bool:
        if self.time_left() > 0:
            return False
        self.emit("skipped", section=section, reason="time budget spent")
        return True

    def median_ms(self, fn, reps: int, warmup: int = 3) -> float:
        """Median wall time of fn() in ms: CUDA events on a GPU, perf_counter on CPU."""
        import torch

        for _ in range(warmup):
            fn()
        times = []
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            for _ in range(reps):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
        else:
            for _ in range(reps):
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)


# -- 1. kernels against torch ------------------------------------------------------------------


def check_kernels(c: Check, dry_run: bool) -> None:
    import torch

    from engine.kernels.triton import attention as attn
    from engine.kernels.triton import kv_store, pointwise

    dev = c.device
    g = torch.Generator().manual_seed(0)
    tolerances = {torch.float32: 1e-4, torch.bfloat16: 2e-2}
    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype).split(".")[-1]

        rnd = functools.partial(_randn, generator=g, dtype=dtype, device=dev)

        # decode: SmolLM2 heads (9 q / 3 kv), contexts at block boundaries and one long one
        lens = [1, 15, 16, 17, 200 if dry_run else 3000]
        block_size, width = 16, math.ceil(max(lens) / 16)
        cache = rnd(len(lens) * width, block_size, 2, 3, 64)
        tables = torch.arange(len(lens) * width, device=dev).view(len(lens), width)
        context_lens = torch.tensor(lens, device=dev)
        q = rnd(len(lens), 9, 64)
        ref = attn.paged_decode_attention_ref(q, cache, tables, context_lens, 0.125)
        for splits in (1, None):
            out = torch.full_like(q, float("nan"))
            attn.paged_decode_attention(q, cache, tables, context_lens, 0.125, out, splits)
            _report_close(c, "decode_attention", name, out, ref, tolerances[dtype], splits=splits)
        # prefill: a fresh chunk and one after a 17-token cached prefix
        cu, prefix = torch.tensor([0, 40, 73], device=dev), torch.tensor([0, 17], device=dev)
        q = rnd(73, 9, 64)
        out = torch.full_like(q, float("nan"))
        attn.paged_prefill_attention(q, cache, tables[:2], cu, prefix, 40, 0.125, out)
        ref = attn.paged_prefill_attention_ref(q, cache, tables[:2], cu, prefix, 0.125)
        _report_close(c, "prefill_attention", name, out, ref, tolerances[dtype])
        # KV store, into a strided view like the fused projection's output
        kv = rnd(5, 15, 64)[:, 9:].view(5, 2, 3, 64)
        slots = torch.tensor([3, 70, -1, 0, 31], device=dev)
        got, want = cache.clone(), cache.clone()
        kv_store.store_kv(kv, got, slots)
        kv_store.store_kv_ref(kv, want, slots)
        c.emit("kernel", kernel="kv_store", dtype=name, ok=bool(torch.equal(got, want)))
        # int8 KV cache: quantize on store (bit-equal to quantize_kv), decode reads the codes
        from engine.quant.kv_int8 import quantize_kv

        codes = torch.zeros(cache.shape, dtype=torch.int8, device=dev)
        scales = torch.zeros(cache.shape[:-1], dtype=torch.float32, device=dev)
        kv_store.store_kv_int8(kv, codes, scales, slots)
        want_codes, want_scales = quantize_kv(kv[slots >= 0])
        stored = slots[slots >= 0]
        ok = torch.equal(codes.view(-1, 2, 3, 64)[stored], want_codes) and torch.equal(
            scales.view(-1, 2, 3)[stored], want_scales
        )
        c.emit("kernel", kernel="kv_store_int8", dtype=name, ok=bool(ok))
        _sweep_kv_store_int8(c, name, rnd, g, trials=4 if dry_run else 100)
        codes, scales = quantize_kv(cache.view(-1, 2, 3, 64))
        codes, scales = codes.view(cache.shape), scales.view(cache.shape[:-1]).contiguous()
        q = rnd(len(lens), 9, 64)
        out = torch.full_like(q, float("nan"))
        attn.paged_decode_attention(
            q, codes, tables, context_lens, 0.125, out, kv_scales=scales
        )  # fmt: skip
        ref = attn.paged_decode_attention_ref(q, codes, tables, context_lens, 0.125, scales)
        _report_close(c, "decode_attention_int8kv", name, out, ref, tolerances[dtype])
        # fused add + RMSNorm, RoPE in place, SiLU * mul
        x, res, w = rnd(7, 576), rnd(7, 576), rnd(576)
        out, out_res = pointwise.rms_norm(x, w, 1e-5, res)
        ref, ref_res = pointwise.rms_norm_ref(x, w, 1e-5, res)
        _report_close(c, "add_rms_norm", name, out, ref, 2**-6)
        _report_close(c, "add_rms_norm_residual", name, out_res, ref_res, 2**-6)
        qkv = rnd(7, 15, 64)
        angles = torch.rand(7, 1, 32, generator=g)
        cos = torch.cat([angles.cos()] * 2, -1).to(dtype).to(dev)
        sin = torch.cat([-angles.sin(), angles.sin()], -1).to(dtype).to(dev)
        got, want = qkv.clone(), qkv.clone()
        pointwise.rotary_(got[:, :12], cos, sin)
        pointwise.rotary_ref_(want[:, :12], cos, sin)
        _report_close(c, "rotary", name, got, want, 2**-6)
        gate_up = rnd(7, 3072) * 3
        out = pointwise.silu_and_mul(gate_up[:, :1536], gate_up[:, 1536:])
        ref = pointwise.silu_and_mul_ref(gate_up[:, :1536], gate_up[:, 1536:])
        _report_close(c, "silu_and_mul", name, out, ref, 2**-6)


def _sweep_kv_store_int8(c: Check, dtype_name, rnd, g, trials: int) -> None:
    """Many stores of 64 tokens at random magnitudes: how many codes and scales differ from
    quantize_kv's, and how many scales from the correctly rounded amax / 127 (from float64).
    One check passed by luck where ~5% of the scales were one bit off (torch divided by the
    number 127 as a product with its reciprocal on CUDA)."""
    import torch

    from engine.kernels.triton import kv_store
    from engine.quant.kv_int8 import quantize_kv

    codes_off = scales_off = scales_inexact = num_scales = 0
    for _ in range(trials):
        kv = rnd(64, 2, 3, 64) * float(10 ** torch.randn(1, generator=g))
        slots = torch.randperm(256, generator=g)[:64].to(c.device)
        codes = torch.zeros(64, 4, 2, 3, 64, dtype=torch.int8, device=c.device)
        scales = torch.zeros(64, 4, 2, 3, dtype=torch.float32, device=c.device)
        kv_store.store_kv_int8(kv, codes, scales, slots)
        want_codes, want_scales = quantize_kv(kv)
        got_codes, got_scales = codes.view(-1, 2, 3, 64)[slots], scales.view(-1, 2, 3)[slots]
        amax = kv.float().abs().amax(-1).clamp_min(1e-12)
        exact = (amax.double() / 127.0).float()  # the correctly rounded quotient
        codes_off += int((got_codes != want_codes).sum())
        scales_off += int((got_scales != want_scales).sum())
        scales_inexact += int((got_scales != exact).sum())
        num_scales += exact.numel()
    c.emit(
        "kernel", kernel="kv_store_int8_sweep", dtype=dtype_name, num_scales=num_scales,
        codes_off=codes_off, scales_off=scales_off, scales_inexact=scales_inexact,
        ok=codes_off == scales_off == scales_inexact == 0,
    )  # fmt: skip


def _randn(*shape, generator, dtype, device):
    import torch

    return torch.randn(*shape, generator=generator).to(dtype).to(device)


def _report_close(c: Check, kernel, dtype, got, want, tol, **extra) -> None:
    got, want = got.float(), want.float()
    err = (got - want).abs()
    ok = bool(torch_isfinite_all(got) and (err <= tol + tol * want.abs()).all())
    c.emit("kernel", kernel=kernel, dtype=dtype, max_abs_err=float(err.max()), ok=ok, **extra)


def torch_isfinite_all(t) -> bool:
    import torch

    return bool(torch.isfinite(t).all())


# -- 2. bandwidth ------------------------------------------------------------------------------


def check_bandwidth(c: Check, dry_run: bool) -> None:
    import torch

    from engine.kernels.triton.attention import paged_decode_attention

    dev = c.device
    reps = 3 if dry_run else 20
    numel = (1 << 20) if dry_run else (1 << 29)  # bf16: 2 MiB / 1 GiB
    src = torch.empty(numel, dtype=torch.bfloat16, device=dev).fill_(1.0)
    dst = torch.empty_like(src)
    copy_ms = c.median_ms(functools.partial(dst.copy_, src), reps)
    copy_gbs = 2 * src.numel() * 2 / copy_ms / 1e6  # bytes read + written
    c.emit("copy_bandwidth", bytes=src.numel() * 2, median_ms=copy_ms, gb_per_s=copy_gbs)
    del src, dst

    num_seqs, num_kv_heads, head_dim, block_size = (2, 3, 64, 16) if dry_run else (32, 3, 64, 16)
    contexts = (64, 128) if dry_run else (512, 1024, 2048, 4096, 8192, 16384, 32768)
    for context in contexts:
        if c.out_of_time("decode_bandwidth"):
            return
        width = context // block_size
        cache = torch.randn(num_seqs * width, block_size, 2, num_kv_heads, head_dim, device=dev).to(
            torch.bfloat16
        )
        perm = torch.randperm(num_seqs * width, device=dev)
        tables = perm.view(num_seqs, width)
        lens = torch.full((num_seqs,), context, device=dev)
        q = torch.randn(num_seqs, 9, head_dim, device=dev).to(torch.bfloat16)
        out = torch.empty_like(q)
        attend = functools.partial(paged_decode_attention, q, cache, tables, lens, 0.125, out)
        ms = c.median_ms(attend, reps)
        read = cache.numel() * cache.element_size()
        gbs = read / ms / 1e6
        c.emit(
            "decode_attention", context=context, num_seqs=num_seqs, median_us=ms * 1e3,
            gb_per_s=gbs, fraction_of_copy=gbs / copy_gbs,
        )  # fmt: skip
        del cache


# -- 3. prefill: Triton paged vs SDPA ------------------------------------------------------


def check_prefill(c: Check, dry_run: bool) -> None:
    import torch

    from engine.kernels.triton.attention import paged_prefill_attention

    dev, reps = c.device, (2 if dry_run else 10)
    for num_tokens, prefix in ((64, 0), (64, 32)) if dry_run else ((2048, 0), (512, 1536)):
        total = prefix + num_tokens
        width = math.ceil(total / 16)
        cache = torch.randn(width, 16, 2, 3, 64, device=dev).to(torch.bfloat16)
        tables = torch.arange(width, device=dev)[None]
        cu = torch.tensor([0, num_tokens], device=dev)
        prefixes = torch.tensor([prefix], device=dev)
        q = torch.randn(num_tokens, 9, 64, device=dev).to(torch.bfloat16)
        triton_ms = c.median_ms(
            functools.partial(
                paged_prefill_attention, q, cache, tables, cu, prefixes, num_tokens, 0.125
            ),
            reps,
        )
        flat = cache.view(-1, 2, 3, 64)
        sdpa_ms = c.median_ms(functools.partial(_sdpa_prefill, q, flat, prefix), reps)
        c.emit(
            "prefill_attention_time", num_tokens=num_tokens, prefix=prefix,
            triton_ms=triton_ms, sdpa_ms=sdpa_ms, triton_over_sdpa=triton_ms / sdpa_ms,
        )  # fmt: skip


def _sdpa_prefill(q, flat_cache, prefix: int):
    """What the torch path does for a chunk: gather its context contiguous, then SDPA
    (FlashAttention for a fresh chunk, a masked kernel after a prefix)."""
    import torch
    import torch.nn.functional as F

    total = prefix + q.shape[0]
    kv = flat_cache.index_select(0, torch.arange(total, device=q.device))
    keys, values = kv[:, 0].transpose(0, 1)[None], kv[:, 1].transpose(0, 1)[None]
    mask = None
    if prefix:
        pos = torch.arange(prefix, total, device=q.device)
        mask = torch.arange(total, device=q.device)[None, :] <= pos[:, None]
    return F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], keys, values, attn_mask=mask,
        is_causal=mask is None, enable_gqa=True,
    )  # fmt: skip


# -- 4./5. the engine ------------------------------------------------------------------------


def prepare_model(model: str | None, dry_run: bool, workdir: Path) -> Path:
    """A checkpoint directory with weights (random ones written where it has none)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if dry_run:
        repo = Path(__file__).resolve().parents[1]
        sys.path.insert(0, str(repo))
        from tests.tiny_model import make_tiny_llama

        return make_tiny_llama(workdir / "tiny")
    if model is None:
        from engine.loader import DEFAULT_MODEL_ALIAS, cache_dir

        cached = cache_dir() / "models" / DEFAULT_MODEL_ALIAS
        if (cached / "model.safetensors").is_file():
            return cached
        config = LlamaConfig(**SMOLLM2_CONFIG)
        source = None
    else:
        source = Path(model)
        if any(source.glob("*.safetensors")):
            return source
        config = LlamaConfig.from_pretrained(source)
    out = workdir / "model"
    torch.manual_seed(0)
    with torch.device("cuda"):
        hf = LlamaForCausalLM(config).to(torch.bfloat16)
    hf.save_pretrained(out)
    if source is not None:
        for f in source.iterdir():
            if f.is_file() and not (out / f.name).exists():
                (out / f.name).write_bytes(f.read_bytes())
    return out


def prompts_for(model_path: Path, n: int) -> list[list[int]]:
    import torch

    from engine.loader import load_tokenizer
    from loadtest.workloads import chat_prompts

    tokenizer = load_tokenizer(model_path)
    if tokenizer is not None:
        return chat_prompts(tokenizer, n)
    g = torch.Generator().manual_seed(0)
    low, high = CHAT_PROMPT_LENGTHS
    return [
        torch.randint(3, 1000, (low + i * (high - low) // max(n - 1, 1),), generator=g).tolist()
        for i in range(n)
    ]


def make_engine(model_path: Path, use_cuda_graphs: bool, dry_run: bool, **options):
    import engine.llm_engine as llm_engine

    if not dry_run:  # the engine's own switch: CudaModelRunner, graphs on or off
        options.update(device="cuda", cuda_graphs=use_cuda_graphs)
        return llm_engine.LLMEngine(str(model_path), dtype="bfloat16", **options)
    from engine.cuda_graphs import EagerReplayCapture
    from engine.cuda_runner import CudaModelRunner

    # The CUDA runner on the CPU, graphs stubbed (no CUDA graphs without CUDA), in place of the
    # CPU runner the engine picks for device="cpu".
    llm_engine.ModelRunner = functools.partial(
        CudaModelRunner, device="cpu", use_cuda_graphs=use_cuda_graphs,
        graph_capture=EagerReplayCapture(),
    )  # fmt: skip
    # float32: the interpreter computes bf16 dots wrongly. Few, narrow graph buckets: the
    # interpreter runs every program in Python.
    options.update(device="cpu", max_num_seqs=4, max_model_len=128, num_kv_blocks=256)
    return llm_engine.LLMEngine(str(model_path), dtype="float32", **options)


def check_decode_step(c: Check, model_path: Path, dry_run: bool) -> None:
    import torch

    from engine.sampling_params import SamplingParams
    from engine.scheduler_output import ScheduledRequest

    context = 64 if dry_run else 512
    eng = make_engine(model_path, True, dry_run, max_num_seqs=32, num_kv_blocks=1032)
    runner = eng.runner
    blocks_per_seq = context // 16
    for num_seqs in (1, 4) if dry_run else (1, 32):
        scheduled = [
            ScheduledRequest(
                request_id=str(i),
                token_ids=[7],
                start_position=context - 1,
                block_ids=list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)),
                needs_sample=True,
                params=SamplingParams(temperature=0.0),
                seed=0,
            )  # fmt: skip
            for i in range(num_seqs)
        ]
        batch = runner._prepare(scheduled)
        reps = 2 if dry_run else 50
        with torch.inference_mode():
            inputs = (batch.input_ids, batch.positions, batch.meta)
            eager = runner.model(*inputs).float()  # rewrites the same K/V: idempotent
            replayed = runner.graphs.run(*inputs).float()
            # The graph's wider block table changes the split count, so bf16 sums differ in
            # order: agreement is judged relative to the hidden states' scale.
            err, scale = float((eager - replayed).abs().max()), float(eager.abs().max())
            c.emit(
                "cuda_graph_replay", num_seqs=num_seqs, max_abs_err=err, scale=scale,
                ok=err <= 0.05 * scale,
            )  # fmt: skip
            eager_ms = c.median_ms(functools.partial(runner.model, *inputs), reps)
            graph_ms = c.median_ms(functools.partial(runner.graphs.run, *inputs), reps)
        c.emit(
            "decode_step", num_seqs=num_seqs, context=context, eager_ms=eager_ms,
            cuda_graph_ms=graph_ms, speedup=eager_ms / graph_ms,
            capture_s=runner.graphs.capture_s,
        )  # fmt: skip


def run_workload(eng, prompts: list[list[int]], max_tokens: int) -> tuple[int, float]:
    from engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    eng.add_request("warmup", prompts[0], SamplingParams(max_tokens=4, temperature=0.0))
    while eng.has_unfinished_requests():
        eng.step()
    start = time.perf_counter()
    num_tokens = 0
    for i, p in enumerate(prompts):
        eng.add_request(str(i), p, params)
    while eng.has_unfinished_requests():
        for delta in eng.step():
            num_tokens += len(delta.token_ids)
    return num_tokens, time.perf_counter() - start


def run_hf(model_path: Path, prompts: list[list[int]], max_tokens: int, c: Check, dtype):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).to(c.device).eval()
    pad = model.generation_config.pad_token_id or 0

    def generate(batch, n):
        width = max(len(p) for p in batch)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch], device=c.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=c.device)
        start = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                do_sample=False, pad_token_id=pad,
            )  # fmt: skip
        if c.device.type == "cuda":
            torch.cuda.synchronize()
        return (out.shape[1] - width) * len(batch), time.perf_counter() - start

    generate(prompts[:1], 4)  # warm-up
    return {name: generate(batch, max_tokens) for name, batch in _workloads(prompts)}


def _workloads(prompts):
    return (("W1", prompts[:1]), ("W2", prompts))


def check_throughput(c: Check, model_path: Path, dry_run: bool) -> None:
    import torch

    num_prompts, max_tokens = (4, 4) if dry_run else (32, 128)
    prompts = prompts_for(model_path, num_prompts)
    hf_dtype = torch.float32 if dry_run else torch.bfloat16
    if c.out_of_time("hf_generate"):
        return
    hf = run_hf(model_path, prompts, max_tokens, c, hf_dtype)
    for name, (num_tokens, elapsed) in hf.items():
        c.emit("throughput", impl="hf_generate", workload=name, tokens=num_tokens,
               elapsed_s=elapsed, tokens_per_s=num_tokens / elapsed)  # fmt: skip
    # The int8 KV cache last: its store and decode kernels in the engine, under graphs.
    for graphs, kv_dtype in ((True, "auto"), (False, "auto"), (True, "int8")):
        if c.out_of_time(f"engine_cuda_graphs_{graphs}_kv_{kv_dtype}"):
            return
        eng = make_engine(
            model_path, graphs, dry_run, max_num_seqs=64, max_num_batched_tokens=2048,
            kv_cache_dtype=kv_dtype,
        )  # fmt: skip
        for name, batch in _workloads(prompts):
            num_tokens, elapsed = run_workload(eng, batch, max_tokens)
            hf_tokens, hf_elapsed = hf[name]
            rate = num_tokens / elapsed
            c.emit(
                "throughput", impl="engine", cuda_graphs=graphs, kv_cache_dtype=kv_dtype,
                workload=name, tokens=num_tokens, elapsed_s=elapsed, tokens_per_s=rate,
                vs_hf=rate / (hf_tokens / hf_elapsed), ok=num_tokens == len(batch) * max_tokens,
            )  # fmt: skip
        del eng


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="checkpoint dir (weights optional)")
    parser.add_argument("--budget-s", type=float, default=270.0)
    parser.add_argument("--dry-run", action="store_true", help="CPU + Triton interpreter, tiny")
    parser.add_argument(
        "--sections", default="kernels,bandwidth,prefill,engine", help="comma-separated subset"
    )
    args = parser.parse_args(argv)
    if args.dry_run:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports Triton
    shimmed = install_missing_module_shims()
    repo = Path(__file__).resolve().parents[1]
    if str(repo) not in sys.path:
        sys.path.insert(0, str(repo))
    import torch
    import triton

    if not args.dry_run and not torch.cuda.is_available():
        print("no CUDA device: use --dry-run (CPU, Triton interpreter)", file=sys.stderr)
        return 2
    device = torch.device("cpu" if args.dry_run else "cuda")
    c = Check(args.budget_s, device)
    c.emit(
        "device", device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        dry_run=args.dry_run, torch=torch.__version__, triton=triton.__version__,
        python=sys.version.split()[0], shimmed=shimmed,
    )  # fmt: skip
    sections = [
        ("kernels", lambda: check_kernels(c, args.dry_run)),
        ("bandwidth", lambda: check_bandwidth(c, args.dry_run)),
        ("prefill", lambda: check_prefill(c, args.dry_run)),
    ]
    with tempfile.TemporaryDirectory() as tmp:
        model_path: list[Path] = []

        def engine_sections():
            model_path.append(prepare_model(args.model, args.dry_run, Path(tmp)))
            c.emit("model", path=str(model_path[0]))
            check_decode_step(c, model_path[0], args.dry_run)
            check_throughput(c, model_path[0], args.dry_run)

        sections.append(("engine", engine_sections))
        wanted = set(args.sections.split(","))
        for name, run in sections:
            if name not in wanted:
                continue
            if c.out_of_time(name):
                continue
            t0 = time.perf_counter()
            try:
                run()
            except Exception as exc:  # one broken section must not hide the others' numbers
                c.emit("error", section=name, error=f"{type(exc).__name__}: {exc}", ok=False)
            c.emit("section_done", section=name, elapsed_s=time.perf_counter() - t0)
    c.emit("done", elapsed_s=time.perf_counter() - c.start, num_failed=c.num_failed)
    return 1 if c.num_failed else 0


if __name__ == "__main__":
    sys.exit(main())
