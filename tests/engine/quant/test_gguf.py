"""GGUF weights load from the file itself: Q4_0 and Q4_1 blocks become int4 (group 32) codes,
scales and minimums exactly (checked against the `gguf` package's own dequantization of what
its writer wrote); Q8_0 and K-quants are dequantized and quantized again by the layer; floats
load exactly (the fp32 path stays HF-exact); unsupported types get an error naming what is."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGUFReader
from gguf.quants import dequantize
from hypothesis import example, given, settings
from hypothesis import strategies as st
from transformers import AutoConfig, AutoModelForCausalLM

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.layers.attention import TorchPagedAttention
from engine.model_runner import ModelRunner
from engine.models import get_model_class
from engine.precision import bf16_runs_fast, resolve_precision
from engine.quant import load_model_weights
from engine.quant.config import QuantConfig
from engine.quant.gguf import (
    decode_q4_0,
    decode_q4_1,
    loads_as_is,
    native_scheme,
    unpermute_rows,
)
from engine.quant.primitives import (
    dequantize_int4,
    quantize_int4_groupwise,
    quantize_int8_per_channel,
)
from tests.tiny_gguf import llama_cpp_permute, make_gguf_model, write_gguf
from tests.tiny_model import make_tiny_llama

DECODERS = {"Q4_0": decode_q4_0, "Q4_1": decode_q4_1}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("gguf-llama"), seed=5)


def _gguf_dequantized(path, name) -> torch.Tensor:
    tensor = next(t for t in GGUFReader(str(path)).tensors if t.name == name)
    values = dequantize(np.asarray(tensor.data), tensor.tensor_type)
    return torch.from_numpy(np.array(values, dtype=np.float32))


@settings(max_examples=25, deadline=None)
@given(
    type_name=st.sampled_from(sorted(DECODERS)),
    rows=st.integers(1, 6),
    num_blocks=st.integers(1, 4),
    magnitude=st.sampled_from([1e-4, 1.0, 300.0]),
    seed=st.integers(0, 2**16),
)
def test_q4_blocks_decode_exactly(tmp_path_factory, type_name, rows, num_blocks, magnitude, seed):
    values = np.random.default_rng(seed).standard_normal((rows, 32 * num_blocks)) * magnitude
    path = tmp_path_factory.mktemp("q4") / "t.gguf"
    write_gguf(path, {"blk.0.ffn_down.weight": (values.astype(np.float32), type_name)})
    tensor = GGUFReader(str(path)).tensors[0]
    assert tensor.tensor_type.name == type_name
    codes, scale, minimum = DECODERS[type_name](np.asarray(tensor.data))
    assert codes.shape == (rows, 32 * num_blocks) and codes.dtype == torch.uint8
    assert scale.shape == minimum.shape == (rows, num_blocks) and int(codes.max()) <= 15
    expected = _gguf_dequantized(path, "blk.0.ffn_down.weight").reshape(rows, -1)
    assert torch.equal(dequantize_int4(codes, scale, minimum), expected)


@pytest.mark.parametrize("num_heads", [1, 2, 4])
def test_unpermute_inverts_llama_cpp_permutation(num_heads):
    w = np.arange(16 * 3, dtype=np.float32).reshape(16, 3)
    permuted = torch.from_numpy(llama_cpp_permute(w, num_heads))
    assert torch.equal(unpermute_rows(permuted, num_heads), torch.from_numpy(w))


def _build_model(path, quant):
    hf_config = AutoConfig.from_pretrained(path)
    model_class = get_model_class(hf_config)
    return model_class(hf_config, torch.float32, 64, TorchPagedAttention(), quant)


@pytest.mark.parametrize(
    ("projection_type", "scheme", "as_is"),
    [("Q4_0", "int4", True), ("Q4_1", "int4", True), ("Q8_0", "int8", False)],
)
def test_gguf_model_runs_in_its_own_quantization(
    tiny_dir, tmp_path, projection_type, scheme, as_is
):
    """The "auto" default picks the GGUF's scheme; int4 layers hold its blocks bit for bit (q/k rows
    unpermuted); Q8_0 rows are the per-channel int8 quantization of gguf's dequantization."""
    model_dir = make_gguf_model(tiny_dir, tmp_path / "m", projection_type)
    gguf_path = model_dir / "model.gguf"
    assert native_scheme(gguf_path) == scheme
    hf_config = AutoConfig.from_pretrained(model_dir)
    dtype, quant = resolve_precision(model_dir, hf_config, "auto", "auto")
    assert quant.scheme == scheme and loads_as_is(gguf_path, quant) is as_is
    assert dtype == (torch.bfloat16 if bf16_runs_fast() else torch.float32)
    model = _build_model(model_dir, quant)
    origin = load_model_weights(model, model_dir, quant, cache_root=tmp_path / "qc", pack=False)
    assert origin == ("gguf" if as_is else "quantized")
    layer = model.model.layers[1]
    q = unpermute_rows(_gguf_dequantized(gguf_path, "blk.1.attn_q.weight"), 4)
    k = unpermute_rows(_gguf_dequantized(gguf_path, "blk.1.attn_k.weight"), 2)
    down = _gguf_dequantized(gguf_path, "blk.1.ffn_down.weight")
    if as_is:
        qkv = layer.self_attn.qkv_proj.dequantized_weight()
        assert torch.equal(qkv[:64], q) and torch.equal(qkv[64:96], k)
        assert torch.equal(layer.mlp.down_proj.dequantized_weight(), down)
    else:
        codes, scale = quantize_int8_per_channel(down)
        assert torch.equal(layer.mlp.down_proj.weight.data, codes)
        assert torch.equal(layer.mlp.down_proj.scale, scale)
    embedding = _gguf_dequantized(gguf_path, "token_embd.weight")
    assert torch.equal(model.model.embed_tokens.weight.data, embedding)
    # Then it runs: a packed runner from the same directory, with the resolved defaults.
    runner = ModelRunner(model_dir, EngineConfig(num_kv_blocks=8), "auto", "auto")
    assert runner.quant.scheme == scheme and runner.dtype == dtype


def test_fp32_from_a_float_gguf_matches_hf(tiny_dir, tmp_path):
    """dtype float32 + no quantization: the GGUF's weights as they are, HF-exact greedy."""
    model_dir = make_gguf_model(tiny_dir, tmp_path / "m", "F32")
    assert native_scheme(model_dir / "model.gguf") is None
    llm = LLM(model_dir, dtype="float32", quantization=None, num_kv_blocks=32)
    assert llm.engine.runner.quant is None and llm.engine.dtype == torch.float32
    prompt = llm.tokenizer.encode("The quick brown fox")
    out = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0))[0]
    hf = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        expected = hf.generate(
            torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        )[0, len(prompt):].tolist()  # fmt: skip
    assert out.token_ids == expected[: len(out.token_ids)] and len(out.token_ids) > 0


def test_explicit_options_override_the_gguf(tiny_dir, tmp_path):
    model_dir = make_gguf_model(tiny_dir, tmp_path / "m", "Q4_1")
    hf_config = AutoConfig.from_pretrained(model_dir)
    assert resolve_precision(model_dir, hf_config, "float32", None) == (torch.float32, None)
    assert resolve_precision(model_dir, hf_config, "auto", "none")[1] is None
    dtype, quant = resolve_precision(model_dir, hf_config, "auto", "int8")
    assert quant.scheme == "int8"
    assert resolve_precision(model_dir, hf_config, "auto", "auto", device="cuda")[1] is None
    # int4 with another group size cannot take the blocks as they are: quantized again.
    assert not loads_as_is(model_dir / "model.gguf", QuantConfig("int4", 64))


def test_layers_are_handed_over_once_each_when_all_their_rows_are_in(tiny_dir, tmp_path):
    """`on_filled` (where the loader packs a layer and frees its canonical tensors) sees every
    quantized layer once, fused q/k/v and gate/up only after their last shard, the tied head
    after it was made from the embedding."""
    import engine.quant.gguf as gguf
    from engine.loader import load_weights
    from engine.quant.cache import quant_modules

    model_dir = make_gguf_model(tiny_dir, tmp_path / "m", "Q4_1")
    hf_config = AutoConfig.from_pretrained(model_dir)
    model = _build_model(model_dir, QuantConfig("int4"))
    load_weights(model, model_dir, skip_modules=frozenset(quant_modules(model)))
    seen = {}
    gguf.load_quantized_layers(
        model, model_dir / "model.gguf", hf_config,
        lambda module: seen.setdefault(id(module), module.dequantized_weight().clone()),
    )  # fmt: skip
    modules = quant_modules(model)
    assert len(seen) == len(modules)
    for module in modules.values():  # what it held when handed over is what it holds at the end
        assert torch.equal(seen[id(module)], module.dequantized_weight())


def test_dequantize_casts_chunk_by_chunk_to_the_same_values(tmp_path, monkeypatch):
    """Straight into bf16 (no whole float32 table) equals float32 then one cast, chunked or not."""
    import engine.quant.gguf as gguf

    rng = np.random.default_rng(3)
    values = rng.standard_normal((10, 64)).astype(np.float32)
    path = write_gguf(tmp_path / "q.gguf", {"token_embd.weight": (values, "Q8_0")})
    tensor = GGUFReader(str(path)).tensors[0]
    expected = _gguf_dequantized(path, "token_embd.weight")
    for rows in (4, 4096):  # chunked (10 rows in 3 chunks) and whole
        monkeypatch.setattr(gguf, "DEQUANTIZE_ROWS", rows)
        as_float = gguf.dequantize(tensor)
        assert as_float.dtype == torch.float32 and torch.equal(as_float, expected)
        as_bf16 = gguf.dequantize(tensor, torch.bfloat16)
        assert as_bf16.dtype == torch.bfloat16 and torch.equal(as_bf16, as_float.bfloat16())


def _q4_k_blocks(rows: int, blocks_per_row: int, seed: int) -> np.ndarray:
    """Random but valid Q4_K blocks (144 bytes: fp16 d, fp16 dmin, 12 scale bytes, 128 nibble
    bytes): gguf can read K-quants but not write them."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows, blocks_per_row, 144), dtype=np.uint8)
    raw[..., 0:2] = np.full((rows, blocks_per_row, 1), 0.01, np.float16).view(np.uint8)
    raw[..., 2:4] = np.full((rows, blocks_per_row, 1), 0.002, np.float16).view(np.uint8)
    return raw.reshape(rows, blocks_per_row * 144)


def test_k_quants_are_quantized_again(tmp_path):
    path = write_gguf(
        tmp_path / "k.gguf", {"blk.0.ffn_down.weight": (_q4_k_blocks(16, 1, 0), "Q4_K")}
    )
    assert native_scheme(path) == "int4" and not loads_as_is(path, QuantConfig("int4"))
    from engine.quant.gguf import dequantize as ours

    tensor = GGUFReader(str(path)).tensors[0]
    values = ours(tensor)
    assert values.shape == (16, 256)
    assert torch.equal(values, _gguf_dequantized(path, "blk.0.ffn_down.weight"))
    codes, scale, minimum = quantize_int4_groupwise(values)
    assert torch.allclose(dequantize_int4(codes, scale, minimum), values, atol=float(scale.max()))


def test_unsupported_types_get_a_clear_error(tmp_path):
    raw = np.zeros((2, 292), dtype=np.uint8)  # two Q8_K rows of 256: gguf cannot dequantize
    path = write_gguf(tmp_path / "q8k.gguf", {"blk.0.ffn_down.weight": (raw, "Q8_K")})
    with pytest.raises(ValueError, match="projections of type Q8_K.*supported: Q4_0, Q4_1"):
        native_scheme(path)
    from engine.quant.gguf import dequantize as ours

    with pytest.raises(ValueError, match="type Q8_K.*supported"):
        ours(GGUFReader(str(path)).tensors[0])
    other = write_gguf(tmp_path / "x.gguf", {"blk.0.ffn_down.weight": (raw, "Q8_K")}, "gpt2")
    from engine.quant.gguf import architecture
    from engine.quant.gguf_index import read_index

    with pytest.raises(ValueError, match="architecture 'gpt2' is not supported"):
        architecture(read_index(other))
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf at all")
    with pytest.raises(ValueError, match="is not a GGUF file"):
        read_index(tmp_path / "junk.gguf")


def test_index_reads_what_gguf_reader_reads(tiny_dir, tmp_path):
    from engine.quant.gguf_index import read_index

    model_dir = make_gguf_model(tiny_dir, tmp_path / "m", "Q4_1")
    ours, theirs = read_index(model_dir / "model.gguf"), GGUFReader(str(model_dir / "model.gguf"))
    assert ours.architecture == "llama" and len(ours.tensors) == len(theirs.tensors) > 0
    for a, b in zip(ours.tensors, theirs.tensors, strict=True):
        assert (a.name, a.tensor_type, a.n_elements) == (b.name, b.tensor_type, int(b.n_elements))
        x, y = np.asarray(a.data), np.asarray(b.data)
        assert x.dtype == y.dtype and np.array_equal(x, y), a.name


@settings(max_examples=40, deadline=None)
@example(cut=1234, flips=[472], seed=0)  # a flipped dim: numpy's memmap overflowed
@given(
    cut=st.integers(0, 4000),
    flips=st.lists(st.integers(0, 3999), max_size=4),
    seed=st.integers(0, 9),
)
def test_index_of_a_damaged_file_is_a_clear_error_or_a_consistent_index(
    tmp_path_factory, tiny_dir, cut, flips, seed
):
    """Truncated or bit-flipped headers: ValueError (never a crash or a huge allocation), or an
    index whose tensors all lie inside the file."""
    from engine.quant.gguf_index import read_index

    folder = tmp_path_factory.mktemp("damaged")
    source = make_gguf_model(tiny_dir, folder / "m", "Q4_0") / "model.gguf"
    raw = bytearray(source.read_bytes()[: max(cut, 1) if cut < 4000 else None])
    rng = np.random.default_rng(seed)
    for position in flips:
        if position < len(raw):
            raw[position] ^= int(rng.integers(1, 256))
    damaged = folder / "damaged.gguf"
    damaged.write_bytes(bytes(raw))
    try:
        index = read_index(damaged)
    except ValueError:
        return
    for tensor in index.tensors:
        try:
            data = tensor.data
        except ValueError:  # numpy refuses a mapping past the end of the file
            continue
        assert data.nbytes <= len(raw)


def test_tied_head_from_the_file_equals_the_head_from_the_loaded_table(tiny_dir, tmp_path):
    """Where the embedding will be looked up in the int8 head's codes (an int8 KV cache), the
    tied head is quantized from the file's table rows and the table is never loaded: the same
    codes and scales as quantizing the loaded table."""
    from engine import LLMEngine, SamplingParams
    from engine.quant import gguf as gguf_module
    from engine.quant.embedding import HeadEmbedding

    model_dir = make_gguf_model(tiny_dir, tmp_path / "m", "Q4_1")
    calls = []
    real = gguf_module.dequantized_rows
    gguf_module.dequantized_rows = lambda *a, **k: calls.append(a[0].name) or real(*a, **k)
    try:
        from_file = LLMEngine(
            model_dir, dtype="bfloat16", quantization="int4", kv_cache_dtype="int8",
            num_kv_blocks=32,
        )  # fmt: skip
    finally:
        gguf_module.dequantized_rows = real
    assert "token_embd.weight" in calls  # the head came from the file's rows
    assert isinstance(from_file.runner.model.model.embed_tokens, HeadEmbedding)
    # The reference: the table loaded, then the head quantized from it (the path before).
    hf_config = AutoConfig.from_pretrained(model_dir)
    quant = from_file.runner.quant
    model = get_model_class(hf_config)(hf_config, torch.bfloat16, 64, TorchPagedAttention(), quant)
    load_model_weights(model, model_dir, quant, tmp_path / "qc")  # packed; the table kept
    assert isinstance(model.model.embed_tokens, torch.nn.Embedding)
    head, reference = from_file.runner.model.lm_head, model.lm_head
    assert torch.equal(head.cpp_codes, reference.cpp_codes)
    assert torch.equal(head.cpp_scales, reference.cpp_scales)
    from_file.add_request("r", [5, 6, 7, 8], SamplingParams(max_tokens=6, ignore_eos=True))
    tokens = []
    while from_file.has_unfinished_requests():
        tokens += [t for d in from_file.step() for t in d.token_ids]
    assert len(tokens) == 6  # and it runs


@settings(max_examples=25, deadline=None)
@given(
    type_name=st.sampled_from(["Q8_0", "F16", "F32"]),
    rows=st.integers(1, 6),
    num_blocks=st.integers(1, 4),
    magnitude=st.sampled_from([1e-4, 1.0, 300.0]),
    seed=st.integers(0, 2**16),
)
def test_own_decoders_give_the_values_gguf_gives(type_name, rows, num_blocks, magnitude, seed):
    """Q8_0 and floats are decoded without the gguf package: the same values, bit for bit,
    whole tensors and single rows alike."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    from engine.quant import gguf as gguf_module
    from engine.quant.gguf_index import BlockType

    rng = np.random.default_rng(seed)
    values = (rng.standard_normal((rows, 32 * num_blocks)) * magnitude).astype(np.float32)
    gguf_type = GGMLQuantizationType[type_name]
    raw = (
        quantize(values, gguf_type)
        if type_name == "Q8_0"
        else values.astype(np.float16 if type_name == "F16" else np.float32)
    )
    assert BlockType[type_name] == gguf_type  # the same ids
    decode = gguf_module._OWN_DECODERS[type_name]
    for data in (raw, raw[0]):
        expected = np.asarray(dequantize(data, gguf_type), dtype=np.float32)
        assert torch.equal(decode(data), torch.from_numpy(expected))


def test_a_q4_1_model_loads_without_the_gguf_or_safetensors_packages(tiny_dir, tmp_path):
    """Q4_1 projections, a Q8_0 table, F32 norms (the default model's types): read, decoded
    and run without importing gguf or safetensors (2.8 and 0.8 MiB of RSS for good)."""
    import subprocess
    import sys

    model_dir = make_gguf_model(tiny_dir, tmp_path / "m", "Q4_1")
    code = (
        "import sys; from engine import LLM, SamplingParams; "
        f"llm = LLM({str(model_dir)!r}); "
        "out = llm.generate(['hi'], SamplingParams(max_tokens=2, temperature=0.0)); "
        "print(len(out[0].token_ids), [m for m in sys.modules if m.split('.')[0] in ('gguf', 'safetensors')])"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split("\n")[-2] == "2 []", result.stdout
