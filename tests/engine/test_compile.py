"""The compiled forward (EngineConfig.compile) against eager, and its fallbacks.

One compiled engine is shared by the module: compiling a tiny model's two graphs takes about a
minute on a loaded 2-core machine (much less once Inductor's on-disk cache has them)."""

from __future__ import annotations

import random

import pytest
from torch._dynamo.utils import counters

import engine.model_runner as model_runner
from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from tests.tiny_model import make_tiny_llama

GREEDY = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
PROMPTS = [list(range(5, 5 + n)) for n in (2, 3, 9, 17, 30)]


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("compile-llama"))


@pytest.fixture(scope="module")
def compiled(tiny_path):
    return LLM(tiny_path, dtype="float32", compile="on", block_size=4, num_kv_blocks=256)


def test_compiled_greedy_tokens_equal_eager(tiny_path, compiled):
    assert compiled.engine.runner.is_compiled
    eager = LLM(tiny_path, dtype="float32", compile="off", block_size=4, num_kv_blocks=256)
    assert not eager.engine.runner.is_compiled
    expected = [o.token_ids for o in eager.generate(PROMPTS, GREEDY)]
    assert [o.token_ids for o in compiled.generate(PROMPTS, GREEDY)] == expected


def test_no_recompiles_in_steady_state(compiled):
    """A few hundred steps of changing batch composition (decodes alone, decodes with prefill
    chunks of many lengths, requests joining and leaving) compile nothing new after warm-up."""
    engine: LLMEngine = compiled.engine
    rng = random.Random(0)
    graphs_before = counters["stats"]["unique_graphs"]
    compiles_before = engine.runner._forward.num_compiles
    num_steps, next_id = 0, 0
    while num_steps < 300:
        if rng.random() < 0.15 and len(engine.scheduler.requests) < 12:
            prompt = [rng.randrange(3, 300) for _ in range(rng.randint(1, 40))]
            params = SamplingParams(max_tokens=rng.randint(1, 30), temperature=0.0)
            engine.add_request(f"s{next_id}", prompt, params)
            next_id += 1
        if engine.has_unfinished_requests():
            engine.step()
            num_steps += 1
    assert next_id > 20
    assert engine.runner._forward.num_compiles == compiles_before
    assert counters["stats"]["unique_graphs"] == graphs_before


def test_no_compiler_runs_eager(tiny_path, monkeypatch):
    monkeypatch.setattr(model_runner, "compiler", lambda: None)
    llm = LLM(tiny_path, dtype="float32", compile="on", block_size=4, num_kv_blocks=64)
    assert not llm.engine.runner.is_compiled
    assert llm.generate([PROMPTS[0]], GREEDY)[0].token_ids


def test_compile_option_values():
    assert EngineConfig(compile=True).compile == "on"
    assert EngineConfig(compile=False).compile == "off"
    assert EngineConfig(compile="AUTO").compile == "auto"
    assert EngineConfig().compile == "auto"
    with pytest.raises(ValueError, match="compile"):
        EngineConfig(compile="fast")
    assert not model_runner.ModelRunner._should_compile("auto")  # measured: see engine/compile.py


def test_bench_reports_compile_apart_from_steady_state(tiny_path):
    """`mini-infer bench engine` separates start-up (load, compile) from throughput: the graphs
    are compiled before the measured run (none during it), and an eager engine reports none."""
    import torch._dynamo

    from loadtest.bench_engine import run_engine

    # A process that compiled the same forward before reuses its graphs (no compile to report):
    # start from none.
    torch._dynamo.reset()
    prompts = [[5, 6, 7], [8, 9, 10, 11]]
    options = {"block_size": 4, "num_kv_blocks": 256}
    compiled = run_engine(str(tiny_path), "float32", prompts, 6, compile="on", **options)
    assert compiled["num_graphs"] >= 1 and compiled["compile_s"] > 0
    assert compiled["compile_in_run_s"] == 0  # steady state: no graph compiled in the run
    assert compiled["output_tokens"] == 12 and compiled["load_s"] > 0
    eager = run_engine(str(tiny_path), "float32", prompts, 6, compile="off", **options)
    assert eager["num_graphs"] == 0 and eager["compile_s"] == 0
