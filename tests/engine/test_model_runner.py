"""ModelRunner against Hugging Face on tiny random checkpoints.

Schedules are built by hand (block ids drawn from a shuffled pool, so a request's blocks are
never contiguous) and every sampled position's logits are compared with HF's full-sequence
forward pass of the same tokens. `ModelRunner.compute_logits` runs a step like `execute` but
returns the logits instead of sampling.
"""

from __future__ import annotations

import json
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import (
    AutoModelForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from engine.config import EngineConfig
from engine.model_runner import ModelRunner
from engine.sampling_params import SamplingParams
from engine.scheduler_output import ScheduledRequest, SchedulerOutput
from tests.hf_reference import hf_model
from tests.tiny_model import make_tiny_llama

GREEDY = SamplingParams(temperature=0.0)
TINY = dict(
    vocab_size=384, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, intermediate_size=128, max_position_embeddings=1024,
)  # fmt: skip


def _save_sharpened(model, path):
    # Like tests/tiny_model.py: scaled-up random weights keep greedy argmax away from ties.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(4.0)
    model.save_pretrained(path)
    return path


def make_tiny_qwen2(path):
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**TINY, tie_word_embeddings=False)).eval()
    assert model.model.layers[0].self_attn.q_proj.bias is not None
    with torch.no_grad():  # non-zero biases, so a dropped bias shows in the logits
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 1.0)
    return _save_sharpened(model, path)


def make_tiny_mistral(path):
    torch.manual_seed(0)
    return _save_sharpened(
        MistralForCausalLM(MistralConfig(**TINY, sliding_window=512)).eval(), path
    )


VARIANTS = {
    "llama-gqa": lambda p: make_tiny_llama(p),
    "llama-mha": lambda p: make_tiny_llama(p, num_key_value_heads=4),
    "llama-mqa-untied": lambda p: make_tiny_llama(p, num_key_value_heads=1, tie_word_embeddings=False),
    "llama3-rope": lambda p: make_tiny_llama(p, rope_parameters={
        "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    "linear-rope": lambda p: make_tiny_llama(
        p, rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}),
    "yarn-rope": lambda p: make_tiny_llama(p, rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
        "original_max_position_embeddings": 256}),
    "dynamic-rope": lambda p: make_tiny_llama(
        p, rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}),
    "qwen2-bias": make_tiny_qwen2,
    "mistral": make_tiny_mistral,
}  # fmt: skip


@pytest.fixture(scope="session")
def variant_dirs(tmp_path_factory):
    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = VARIANTS[name](tmp_path_factory.mktemp(name))
        return cache[name]

    return get


class Harness:
    """A runner, its HF twin, and a shuffled free list of block ids."""

    _hf_cache: dict = {}

    def __init__(self, path, block_size=4, num_kv_blocks=96, dtype=torch.float32, seed=0, **cfg):
        config = EngineConfig(block_size=block_size, num_kv_blocks=num_kv_blocks, **cfg)
        self.runner = ModelRunner(path, config, dtype, quantization=None)
        self.block_size = block_size
        self.free = list(range(num_kv_blocks))
        random.Random(seed).shuffle(self.free)
        key = str(path)
        if key not in self._hf_cache:
            self._hf_cache[key] = hf_model(path)
        self.hf = self._hf_cache[key].eval()

    def blocks_for(self, block_ids: list[int], num_tokens: int) -> list[int]:
        """Grow block_ids to cover num_tokens positions (the runner never allocates)."""
        while len(block_ids) * self.block_size < num_tokens:
            block_ids.append(self.free.pop())
        return block_ids

    def hf_logits(self, tokens: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            return self.hf(torch.tensor([tokens])).logits[0].float()  # [len, vocab]


def req(request_id, tokens, start, block_ids, needs_sample=True, params=GREEDY, seed=0):
    return ScheduledRequest(request_id, list(tokens), start, block_ids, needs_sample, params, seed)


def assert_logits_match(actual: torch.Tensor, expected: torch.Tensor):
    torch.testing.assert_close(actual, expected, rtol=1e-4, atol=2e-4)
    assert int(actual.argmax()) == int(expected.argmax())


def prompt(n, seed, vocab=384):
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(n)]


def run_scenario(h: Harness):
    """Mixed prompt lengths, a chunked prefill next to decodes, then decode steps; every
    sampled logit row is checked against HF."""
    seqs = {"a": prompt(9, 1), "b": prompt(20, 2), "c": prompt(1, 3)}
    blocks = {k: h.blocks_for([], len(v)) for k, v in seqs.items()}
    done = {"a": 0, "b": 0, "c": 0}
    plan = [  # per step: request -> number of new tokens (None: everything pending)
        {"a": None, "b": 12, "c": None},
        {"a": None, "b": None, "c": None},
        {"a": None, "b": None, "c": None},
        {"a": None, "b": None},
    ]
    for step in plan:
        scheduled = []
        for rid, count in step.items():
            pending = seqs[rid][done[rid] :]
            new = pending if count is None else pending[:count]
            h.blocks_for(blocks[rid], done[rid] + len(new))
            scheduled.append(
                req(rid, new, done[rid], blocks[rid], done[rid] + len(new) == len(seqs[rid]))
            )
        logits = h.runner.compute_logits(SchedulerOutput(scheduled))
        assert set(logits) == {r.request_id for r in scheduled if r.needs_sample}
        for r in scheduled:
            done[r.request_id] += len(r.token_ids)
            if r.needs_sample:
                assert_logits_match(logits[r.request_id], h.hf_logits(seqs[r.request_id])[-1])
                seqs[r.request_id].append(int(logits[r.request_id].argmax()))


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_variants_match_hf(variant_dirs, variant):
    run_scenario(Harness(variant_dirs(variant)))


def test_mixed_lengths_in_one_step(variant_dirs):
    h = Harness(variant_dirs("llama-gqa"))
    prompts = [prompt(n, n) for n in (1, 5, 17, 40, 4)]
    scheduled = [req(str(i), p, 0, h.blocks_for([], len(p))) for i, p in enumerate(prompts)]
    logits = h.runner.compute_logits(SchedulerOutput(scheduled))
    for i, p in enumerate(prompts):
        assert_logits_match(logits[str(i)], h.hf_logits(p)[-1])


def test_chunked_prefill_every_chunk_end(variant_dirs):
    h = Harness(variant_dirs("llama-gqa"))
    tokens = prompt(37, 5)
    block_ids = h.blocks_for([], len(tokens))
    reference = h.hf_logits(tokens)
    start = 0
    for size in (16, 1, 15, 5):
        chunk = tokens[start : start + size]
        logits = h.runner.compute_logits(SchedulerOutput([req("r", chunk, start, block_ids)]))
        start += size
        assert_logits_match(logits["r"], reference[start - 1])
    # A chunk that does not end the prompt samples nothing.
    no_sample = h.runner.execute(SchedulerOutput([req("r", tokens[:8], 0, block_ids, False)]))
    assert no_sample.sampled == {} and no_sample.logprobs == {}


def test_greedy_decode_equals_hf_generate(variant_dirs):
    path = variant_dirs("llama-gqa")
    h = Harness(path)
    prompts = {"x": prompt(6, 7), "y": prompt(23, 8)}
    seqs = {k: list(v) for k, v in prompts.items()}
    blocks = {k: h.blocks_for([], len(v)) for k, v in seqs.items()}
    scheduled = [req(k, v, 0, blocks[k]) for k, v in seqs.items()]
    for _ in range(10):
        tokens = h.runner.execute(SchedulerOutput(scheduled)).sampled
        scheduled = []
        for k, token in tokens.items():
            seqs[k].append(token)
            h.blocks_for(blocks[k], len(seqs[k]))
            scheduled.append(req(k, [token], len(seqs[k]) - 1, blocks[k]))
    for k, p in prompts.items():
        expected = h.hf.generate(
            torch.tensor([p]), max_new_tokens=10, do_sample=False,
            attention_mask=torch.ones(1, len(p), dtype=torch.long),
        )[0, len(p) :].tolist()  # fmt: skip
        assert seqs[k][len(p) :] == expected


def test_requests_sharing_prefix_blocks(variant_dirs):
    h = Harness(variant_dirs("llama-gqa"))
    prefix = prompt(12, 9)  # three full blocks of 4
    first = prefix + prompt(3, 10)
    first_blocks = h.blocks_for([], len(first))
    out = h.runner.compute_logits(SchedulerOutput([req("first", first, 0, first_blocks)]))
    assert_logits_match(out["first"], h.hf_logits(first)[-1])
    # The second request reuses the first's full prefix blocks and computes only its suffix.
    second = prefix + prompt(6, 11)
    second_blocks = h.blocks_for(first_blocks[:3], len(second))
    first.append(int(out["first"].argmax()))
    h.blocks_for(first_blocks, len(first))
    logits = h.runner.compute_logits(
        SchedulerOutput([
            req("first", first[-1:], len(first) - 1, first_blocks),  # still decoding alongside
            req("second", second[12:], 12, second_blocks),
        ])
    )  # fmt: skip
    assert_logits_match(logits["second"], h.hf_logits(second)[-1])
    assert_logits_match(logits["first"], h.hf_logits(first)[-1])


@settings(max_examples=12, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 30), min_size=1, max_size=4),
    chunk=st.integers(1, 16),
    num_decodes=st.integers(0, 3),
    block_size=st.sampled_from([1, 2, 4, 16]),
    seed=st.integers(0, 1000),
)
def test_random_schedules_match_hf(variant_dirs, lengths, chunk, num_decodes, block_size, seed):
    """Any split of prompts into chunks, any block placement: logits equal HF's."""
    h = Harness(variant_dirs("llama-gqa"), block_size=block_size, num_kv_blocks=160, seed=seed)
    seqs = {str(i): prompt(n, seed + i) for i, n in enumerate(lengths)}
    targets = {k: len(v) + num_decodes for k, v in seqs.items()}
    blocks = {k: [] for k in seqs}
    done = dict.fromkeys(seqs, 0)
    while any(done[k] < targets[k] for k in seqs):
        scheduled = []
        for k in seqs:
            if done[k] >= targets[k]:
                continue
            new = seqs[k][done[k] : done[k] + chunk]
            h.blocks_for(blocks[k], done[k] + len(new))
            scheduled.append(req(k, new, done[k], blocks[k], done[k] + len(new) == len(seqs[k])))
        logits = h.runner.compute_logits(SchedulerOutput(scheduled))
        for r in scheduled:
            done[r.request_id] += len(r.token_ids)
            if r.needs_sample:
                assert_logits_match(logits[r.request_id], h.hf_logits(seqs[r.request_id])[-1])
                seqs[r.request_id].append(int(logits[r.request_id].argmax()))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_matches_hf_in_same_dtype(variant_dirs, dtype):
    """A prefill gives bit-identical logits to HF run in the same dtype (norms, rope, fused and
    packed projections all round like HF); decode steps stay within a couple of ulps."""
    path = variant_dirs("llama-gqa")
    h = Harness(path, dtype=dtype)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    assert h.runner.kv_cache.dtype == dtype
    tokens = prompt(30, 12)
    block_ids = h.blocks_for([], 34)
    for step in range(4):
        start = 0 if step == 0 else len(tokens) - 1
        new = tokens[start:]
        logits = h.runner.compute_logits(SchedulerOutput([req("r", new, start, block_ids)]))["r"]
        with torch.inference_mode():
            expected = hf(torch.tensor([tokens])).logits[0, -1].float()
        if step == 0:
            assert torch.equal(logits, expected)
        else:
            torch.testing.assert_close(logits, expected, rtol=0.02, atol=0.02)
        tokens.append(int(expected.argmax()))


def test_kv_cache_sizing(variant_dirs):
    path = variant_dirs("llama-gqa")  # 2 layers, 2 KV heads, head_dim 16
    bytes_per_block = 2 * 2 * 16 * 2 * 16 * 4
    runner = ModelRunner(
        path, EngineConfig(kv_cache_memory_bytes=10 * bytes_per_block + 5), "float32"
    )
    assert runner.num_kv_blocks == 10
    assert runner.kv_cache_bytes == 10 * bytes_per_block
    assert runner.max_model_len == 1024  # min(max_position_embeddings, 8192)
    half = ModelRunner(path, EngineConfig(kv_cache_memory_bytes=10 * bytes_per_block), "bfloat16")
    assert half.num_kv_blocks == 20
    pinned = ModelRunner(path, EngineConfig(num_kv_blocks=3, max_model_len=100), torch.float32)
    assert (pinned.num_kv_blocks, pinned.max_model_len) == (3, 100)
    # No more than the configured sequences can use: 2 sequences of 100 tokens = 2 x 7 blocks.
    usable = EngineConfig(max_num_seqs=2, max_model_len=100, kv_cache_memory_bytes=1 << 30)
    assert ModelRunner(path, usable, torch.float32).num_kv_blocks == 14
    budget = EngineConfig(max_num_seqs=2, kv_cache_memory_bytes=10 * bytes_per_block)
    assert ModelRunner(path, budget, torch.float32).num_kv_blocks == 10  # the budget caps it
    with pytest.raises(ValueError, match="max_position_embeddings"):
        ModelRunner(path, EngineConfig(max_model_len=4096), torch.float32)


def test_rejections(variant_dirs, tmp_path, monkeypatch):
    path = variant_dirs("llama-gqa")
    config = EngineConfig(num_kv_blocks=8)
    with pytest.raises(ValueError, match="unknown quantization 'fp4'"):
        ModelRunner(path, config, torch.float32, quantization="fp4")
    if not torch.cuda.is_available():  # Triton on CPU only in its interpreter
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
        with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
            ModelRunner(path, EngineConfig(attention_backend="triton"), torch.float32)
    with pytest.raises(ValueError, match="unsupported dtype"):
        ModelRunner(path, config, "int8")
    runner = ModelRunner(path, config, torch.float32)
    with pytest.raises(ValueError, match="outside the pool"):
        runner.execute(SchedulerOutput([req("r", [5, 6], 0, [8])]))
    with pytest.raises(ValueError, match="do not cover"):
        runner.execute(SchedulerOutput([req("r", [5] * 20, 0, [1])]))
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(
        json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"})
    )
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*LlamaForCausalLM"):
        ModelRunner(gpt2, config, torch.float32)


def test_seeded_sampling_survives_steps_and_resets_when_finished(variant_dirs):
    h = Harness(variant_dirs("llama-gqa"))
    params = SamplingParams(temperature=1.0, top_k=50)
    tokens = prompt(10, 13)
    block_ids = h.blocks_for([], 12)

    def sample_twice(extra):
        # The same step twice: the request's generator advances, so draws can differ.
        first = h.runner.execute(
            SchedulerOutput([req("s", tokens, 0, block_ids, params=params, seed=42)] + extra)
        )
        second = h.runner.execute(
            SchedulerOutput([req("s", tokens, 0, block_ids, params=params, seed=42)])
        )
        return first.sampled["s"], second.sampled["s"]

    alone = sample_twice([])
    h.runner.execute(SchedulerOutput(finished_request_ids=["s"]))
    other = req("o", prompt(5, 14), 0, h.blocks_for([], 5), params=params, seed=7)
    assert sample_twice([other]) == alone  # fresh generator, same seed; batch-mates irrelevant


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_continuous_batching_churn(variant_dirs, seed):
    """Requests join, skip steps, finish and get preempted (re-prefilled into new blocks) while
    others decode: every logit still equals HF's."""
    rng = random.Random(seed)
    path = variant_dirs("llama-gqa")
    h = Harness(path, num_kv_blocks=200, seed=seed)
    seqs: dict[str, list[int]] = {}
    blocks: dict[str, list[int]] = {}
    computed: dict[str, int] = {}
    next_id = 0
    for _ in range(16):
        finished, preempted = [], []
        if len(seqs) < 5 or rng.random() < 0.3:  # a new request arrives
            rid = f"r{next_id}"
            next_id += 1
            seqs[rid], blocks[rid], computed[rid] = prompt(rng.randint(1, 12), rng.random()), [], 0
        for rid in list(seqs):
            roll = rng.random()
            if computed[rid] and roll < 0.1:  # finished: leaves for good
                finished.append(rid)
                del seqs[rid], blocks[rid], computed[rid]
            elif computed[rid] and roll < 0.2:  # preempted: blocks lost, recomputed later
                preempted.append(rid)
                h.free.extend(blocks[rid])
                blocks[rid], computed[rid] = [], 0
        scheduled = []
        for rid in seqs:
            if rng.random() < 0.2:  # not scheduled this step
                continue
            new = seqs[rid][computed[rid] :]
            h.blocks_for(blocks[rid], len(seqs[rid]))
            scheduled.append(req(rid, new, computed[rid], blocks[rid]))
        out = SchedulerOutput(
            scheduled, finished_request_ids=finished, preempted_request_ids=preempted
        )
        logits = h.runner.compute_logits(out)
        for r in scheduled:
            assert_logits_match(logits[r.request_id], h.hf_logits(seqs[r.request_id])[-1])
            seqs[r.request_id].append(int(logits[r.request_id].argmax()))
            computed[r.request_id] += len(r.token_ids)


def test_reused_request_id_after_finish_gets_fresh_state(variant_dirs):
    # Same id, same length, different tokens: nothing of the first request may leak into the
    # second.
    h = Harness(variant_dirs("llama-gqa"))
    for seed in (20, 21):
        tokens = prompt(7, seed)
        block_ids = h.blocks_for([], 9)
        first = h.runner.compute_logits(SchedulerOutput([req("same", tokens, 0, block_ids)]))
        tokens.append(int(first["same"].argmax()))
        logits = h.runner.compute_logits(SchedulerOutput([req("same", tokens[-1:], 7, block_ids)]))
        assert_logits_match(logits["same"], h.hf_logits(tokens)[-1])
        h.runner.execute(SchedulerOutput(finished_request_ids=["same"]))


@pytest.mark.real_model
def test_real_model_chunked_prefill_and_decode_match_hf():
    from engine.loader import fetch_default_model, load_tokenizer

    path = fetch_default_model(progress=False)
    tokenizer = load_tokenizer(path)
    chat = [{"role": "user", "content": "Name three colours of the rainbow."}]
    tokens = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    tokens = tokenizer.encode(tokens)
    h = Harness(path, block_size=16, num_kv_blocks=16)
    block_ids = h.blocks_for([], len(tokens) + 4)
    num_prompt, done = len(tokens), 0
    while len(tokens) < num_prompt + 4:  # 16-token prefill chunks, then 3 decode steps
        new = tokens[done : done + 16]
        logits = h.runner.compute_logits(SchedulerOutput([req("r", new, done, block_ids)]))
        done += len(new)
        if done < len(tokens):
            continue
        expected = h.hf_logits(tokens)[-1]
        torch.testing.assert_close(logits["r"], expected, rtol=1e-4, atol=1e-3)
        assert int(logits["r"].argmax()) == int(expected.argmax())
        tokens.append(int(logits["r"].argmax()))


@pytest.mark.real_model
def test_real_model_bf16_prefill_is_bit_identical_to_hf():
    # SmolLM2's first answer token to this prompt is a near-tie in bf16 (logits 25.875 vs
    # 25.625): one ulp of difference anywhere flips greedy decoding.
    from engine.loader import fetch_default_model, load_tokenizer

    path = fetch_default_model(progress=False)
    tokenizer = load_tokenizer(path)
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    tokens = tokenizer.encode(
        tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    )
    # F.linear's weights, as HF's: the calibrated choice may take our GEMV for the one-row
    # lm_head, which rounds its own way (tested against torch within bf16 rounding instead).
    config = EngineConfig(num_kv_blocks=8, linear_kernel="plain")
    runner = ModelRunner(path, config, torch.bfloat16, quantization=None)
    logits = runner.compute_logits(SchedulerOutput([req("r", tokens, 0, list(range(8)))]))["r"]
    hf = hf_model(path, torch.bfloat16)
    with torch.inference_mode():
        # The head over the last position only, as the engine (and HF's `generate`) computes
        # it: on a CPU without native bf16 torch's bf16 GEMM rounds a 1-row product differently
        # from a 37-row one (the Xeon without avx512_bf16), so the full-prompt head is not the
        # same computation.
        expected = hf(torch.tensor([tokens]), logits_to_keep=1).logits[0, -1].float()
    assert torch.equal(logits, expected)
