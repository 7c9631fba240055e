"""CUDA-graph bookkeeping on CPU: buckets, padding and eager fallback, with the capture
replaced by `EagerReplayCapture` (the seam), the model run through the Triton backend in the
interpreter, and the whole CudaModelRunner on device="cpu" against the plain runner."""

from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig
from engine.cuda_graphs import DecodeGraphs, EagerReplayCapture, bucket_for, graph_batch_sizes
from engine.cuda_runner import CudaModelRunner
from engine.kernels.cpu.linear_choice import available_paths
from engine.model_runner import ModelRunner
from engine.sampling_params import SamplingParams
from engine.scheduler_output import ScheduledRequest, SchedulerOutput
from engine.step_batch import prepare_step


def test_batch_sizes_and_buckets():
    assert graph_batch_sizes(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert graph_batch_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert graph_batch_sizes(1) == [1]
    sizes = graph_batch_sizes(64)
    assert [bucket_for(n, sizes) for n in (1, 3, 8, 9, 17, 64)] == [1, 4, 8, 16, 32, 64]
    assert bucket_for(65, sizes) is None


def req(rid, token_ids, start, block_ids):
    return ScheduledRequest(
        request_id=rid, token_ids=token_ids, start_position=start, block_ids=block_ids,
        needs_sample=True, params=SamplingParams(temperature=0.0), seed=0,
    )  # fmt: skip


@pytest.fixture(scope="module")
def runner(tiny_model_dir):
    config = EngineConfig(
        num_kv_blocks=32, block_size=4, max_model_len=64, attention_backend="triton"
    )
    return ModelRunner(tiny_model_dir, config, torch.float32)


def prefill(runner, requests):
    """Write the requests' prompt K/V into the cache."""
    runner.execute(SchedulerOutput(requests))


def test_padded_replay_matches_eager_and_writes_only_real_slots(runner):
    torch.manual_seed(0)
    prompts = {"a": ([5, 6, 7, 8, 9], [0, 1]), "b": ([11, 12], [2]), "c": ([3] * 7, [3, 4])}
    prefill(runner, [req(r, ids, 0, blocks) for r, (ids, blocks) in prompts.items()])
    decodes = [
        req(r, [1 + i], len(ids), blocks) for i, (r, (ids, blocks)) in enumerate(prompts.items())
    ]
    batch = prepare_step(decodes, runner.block_size)
    capture = EagerReplayCapture()
    graphs = DecodeGraphs(runner.model, [1, 2, 4], 16, torch.device("cpu"), capture)
    graphs.capture_all()
    assert capture.num_captures == 3 and graphs.capture_s is not None
    assert graphs.bucket(batch.meta) == 4  # 3 decodes padded to 4

    before = runner.kv_cache.clone()
    with torch.inference_mode():
        replayed = graphs.run(batch.input_ids, batch.positions, batch.meta).clone()
    after_replay = runner.kv_cache.clone()
    runner.kv_cache.copy_(before)
    with torch.inference_mode():
        eager = runner.model(batch.input_ids, batch.positions, batch.meta)
    assert capture.num_replays == 1
    assert replayed.shape == eager.shape == (3, runner.hf_config.hidden_size)
    torch.testing.assert_close(replayed, eager, atol=1e-5, rtol=1e-5)
    # The padding row (slot -1) wrote nothing: the cache equals the eager step's.
    torch.testing.assert_close(after_replay, runner.kv_cache, atol=1e-6, rtol=0)
    assert graphs.slot_mapping[3] == -1 and graphs.context_lens[3] == 0


def test_fallback_to_eager(runner):
    graphs = DecodeGraphs(runner.model, [1, 2], 2, torch.device("cpu"), EagerReplayCapture())
    ids, pos = torch.zeros(3, dtype=torch.int64), torch.zeros(3, dtype=torch.int64)
    not_captured = prepare_step([req("x", [1], 2, [0])], runner.block_size)
    assert graphs.run(ids[:1], pos[:1], not_captured.meta) is None  # nothing captured yet
    graphs.capture_all()
    too_many = prepare_step([req(f"r{i}", [1], 2, [i]) for i in range(3)], runner.block_size)
    assert graphs.bucket(too_many.meta) is None
    too_wide = prepare_step([req("w", [1], 9, [0, 1, 2])], runner.block_size)  # 3 blocks > 2
    assert graphs.bucket(too_wide.meta) is None
    with_prefill = prepare_step([req("d", [1], 2, [0]), req("p", [1, 2], 0, [1])], 4)
    assert graphs.bucket(with_prefill.meta) is None
    assert graphs.bucket(not_captured.meta) == 1


def test_cuda_runner_on_cpu_matches_plain_runner(tiny_model_dir, runner):
    """CudaModelRunner with device="cpu" and the stub capture: the same greedy tokens as the
    plain runner over prefill, graphed decodes and an eager (non-bucketed) step."""
    config = EngineConfig(
        num_kv_blocks=32, block_size=4, max_model_len=64, max_num_seqs=2, attention_backend="auto"
    )
    capture = EagerReplayCapture()
    cuda_like = CudaModelRunner(
        tiny_model_dir, config, torch.float32, device="cpu", graph_capture=capture
    )
    assert cuda_like.attention.name == "triton"  # "auto" on the CUDA runner
    plain = ModelRunner(tiny_model_dir, config, torch.float32)
    steps = [
        [req("a", [5, 6, 7], 0, [0]), req("b", [8, 9, 10, 11, 12], 0, [1, 2])],
        [req("a", [1], 3, [0]), req("b", [2], 5, [1, 2])],  # graphed, bucket 2
        [req("a", [3], 4, [0, 3])],  # graphed, bucket 1
        [req("a", [4], 5, [0, 3]), req("b", [5], 6, [1, 2]), req("c", [6], 0, [4])],  # eager
    ]
    for step in steps:
        assert cuda_like.execute(SchedulerOutput(step)) == plain.execute(SchedulerOutput(step))
        # (ModelRunnerOutput: the sampled tokens and the (empty) logprobs alike)
    assert capture.num_replays == 2


def test_cuda_runner_returns_prompt_logprobs_like_the_plain_runner(tiny_model_dir, runner):
    """The CUDA runner shares the plain runner's step (only copies and graph replay differ):
    prompt logprob chunks come back, equal to the plain runner's (they were all None)."""
    config = EngineConfig(
        num_kv_blocks=32, block_size=4, max_model_len=64, max_num_seqs=2, attention_backend="auto"
    )
    cuda_like = CudaModelRunner(
        tiny_model_dir, config, torch.float32, device="cpu", graph_capture=EagerReplayCapture()
    )
    plain = ModelRunner(tiny_model_dir, config, torch.float32)
    asking = SamplingParams(temperature=0.0, prompt_logprobs=2, logprobs=1)
    step = [
        ScheduledRequest("a", [5, 6, 7, 8, 9], 0, [0, 1], True, asking, seed=0),
        req("b", [8, 9, 10], 0, [2]),
    ]
    result, expected = (
        cuda_like.execute(SchedulerOutput(step)),
        plain.execute(SchedulerOutput(step)),
    )
    assert result.sampled == expected.sampled
    got, want = result.logprobs, expected.logprobs
    assert set(got) == set(want) == {"a"}
    mine, theirs = got["a"].prompt_chunk, want["a"].prompt_chunk
    assert mine is not None and mine.inner_logprobs.shape == (4,)
    assert torch.equal(mine.topk_ids, theirs.topk_ids)
    assert torch.equal(mine.inner_ranks, theirs.inner_ranks)
    for name in ("topk_logprobs", "inner_logprobs", "last_row"):
        torch.testing.assert_close(getattr(mine, name), getattr(theirs, name), atol=1e-4, rtol=0)
    assert got["a"].sample is not None and set(got["a"].sample) == set(want["a"].sample)


def test_cuda_runner_moves_plain_linears_without_packing_for_this_cpu(tiny_model_dir, monkeypatch):
    """A device runner moves its weights as they are: it neither calibrates nor packs the CPU
    kernels (it used to, then unpacked them), even where the config asks for packed ones."""
    import engine.model_runner as model_runner

    asked, choose = [], model_runner.choose_linears

    def spy(shapes, dtype, requested="auto", step_shapes=()):
        asked.append(requested)
        return choose(shapes, dtype, requested, step_shapes)

    monkeypatch.setattr(model_runner, "choose_linears", spy)
    config = EngineConfig(
        num_kv_blocks=32, block_size=4, max_model_len=64, max_num_seqs=2, linear_kernel="packed"
    )
    cuda_like = CudaModelRunner(
        tiny_model_dir, config, torch.float32, device="cpu", use_cuda_graphs=False
    )
    plain = ModelRunner(tiny_model_dir, config, torch.float32)
    assert asked == ["plain", "packed"]  # the CUDA runner's, then the CPU runner's
    assert cuda_like.linear_kernels["packed"] == cuda_like.linear_kernels["gemv"] == 0
    assert cuda_like.linear_kernels["plain"] > 0
    assert plain.linear_kernels["plain"] == 0 or "packed" not in available_paths(torch.float32)
