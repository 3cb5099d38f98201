"""LoRA adapters in Hugging Face PEFT's format: read into jmem's layout, loaded, served, refused when they
hold what jmem's LoRA cannot, and (where transformers and peft are installed) checked against them."""

import json
import math
import os

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import save_file

from jmem.generate import SamplingParams as GenParams
from jmem.generate import generate_ids
from jmem.io.tokenizer import ByteTokenizer
from jmem.lm import LM, packaged_model_path
from jmem.lora import LoRA, load_adapters, merge, read_adapters
from jmem.models import Llama, LlamaConfig
from jmem.serve.engine import Engine, EngineConfig
from jmem.serve.request import SamplingParams
from tests.helpers import random_adapter

# jmem target -> Hugging Face Llama module, as PEFT names them (written out here, not taken from jmem).
HF = {"wq": "self_attn.q_proj", "wk": "self_attn.k_proj", "wv": "self_attn.v_proj", "wo": "self_attn.o_proj",
      "w_gate": "mlp.gate_proj", "w_up": "mlp.up_proj", "w_down": "mlp.down_proj"}


@pytest.fixture(scope="module")
def model():
    return Llama(LlamaConfig.tiny(), rngs=nnx.Rngs(0))


def key(target, layer, part):
    if target == "head":
        return f"base_model.model.lm_head.lora_{part}.weight"
    return f"base_model.model.model.layers.{layer}.{HF[target]}.lora_{part}.weight"


def lora_tensors(model, seed, plan):
    """PEFT tensors for `plan` {(target, layer): rank}: A [r, in], B [out, r], both random and nonzero."""
    rng = np.random.default_rng(seed)
    out = {}
    for (target, layer), r in plan.items():
        n_in, n_out = base_weight(model, target).shape[-2:]
        out[key(target, layer, "A")] = (rng.normal(size=(r, n_in)) * n_in ** -0.5).astype(np.float32)
        out[key(target, layer, "B")] = (rng.normal(size=(n_out, r)) * 0.5).astype(np.float32)
    return out


def write_peft(folder, tensors, **config):
    """A directory as PEFT's `save_pretrained` writes it (config fields a LoRA adapter of peft 0.21 has)."""
    folder.mkdir()
    fields = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "lora_dropout": 0.0, "use_rslora": False,
              "use_dora": False, "rank_pattern": {}, "alpha_pattern": {}, "bias": "none", "modules_to_save": None,
              "fan_in_fan_out": False, "target_modules": ["q_proj", "v_proj"], "task_type": "CAUSAL_LM"}
    (folder / "adapter_config.json").write_text(json.dumps({**fields, **config}))
    if tensors is not None:
        save_file(tensors, str(folder / "adapter_model.safetensors"))
    return folder


def base_weight(model, target):
    var = model.head.kernel if target == "head" else model.layers.weight_var(target)
    return np.asarray(var.get_value())


def merged_delta(model, path, target):
    merged = merge(load_adapters(model, path))
    return base_weight(merged, target) - base_weight(model, target)


def want_delta(tensors, target, layer, scale):
    a, b = tensors[key(target, layer, "A")], tensors[key(target, layer, "B")]
    return scale * (a.T.astype(np.float64) @ b.T.astype(np.float64))


@pytest.mark.parametrize("rslora", [False, True])
def test_a_peft_adapter_loads_as_its_low_rank_deltas(model, tmp_path, rslora):
    """Every layer of wq, wv, w_down: W + (alpha / r) B A in PEFT's [out, in] terms, i.e. A^T B^T added to
    jmem's [in, out] kernel; rsLoRA scales by alpha / sqrt(r). One alpha and rank: kept as they are."""
    plan = {(t, i): 4 for t in ("wq", "wv", "w_down") for i in range(2)}
    tensors = lora_tensors(model, 0, plan)
    path = write_peft(tmp_path / "ad", tensors, use_rslora=rslora)
    meta, _ = read_adapters(path)
    assert meta["wq"] == {"alpha": 8.0, "rank": 4, "rslora": rslora, "dropout": 0.0, "dtype": "float32"}
    scale = 8 / (math.sqrt(4) if rslora else 4)
    for target in ("wq", "wv", "w_down"):
        delta = merged_delta(model, path, target)
        for layer in range(2):
            np.testing.assert_allclose(delta[layer], want_delta(tensors, target, layer, scale), rtol=1e-4, atol=1e-5)
    assert not np.any(merged_delta(model, path, "wk"))


def test_rank_and_alpha_patterns_and_left_out_layers_fold_into_b(model, tmp_path):
    """PEFT's per-module rank_pattern / alpha_pattern and an adapter on layer 1 only: each layer keeps its own
    scale (folded into its B; ranks padded to the largest) and layer 0 of w_down stays the base weight."""
    plan = {("wq", 0): 4, ("wq", 1): 4, ("wv", 0): 2, ("wv", 1): 2, ("w_down", 1): 4, ("head", None): 3}
    tensors = lora_tensors(model, 1, plan)
    path = write_peft(tmp_path / "ad", tensors, target_modules=["q_proj", "v_proj", "down_proj", "lm_head"],
                      layers_to_transform=None, rank_pattern={"v_proj": 2, "lm_head": 3},
                      alpha_pattern={"model.layers.1.self_attn.q_proj": 3, "down_proj": 6})
    meta, arrays = read_adapters(path, n_layers=2)
    assert meta["wq"]["rank"] == 4 and meta["wq"]["alpha"] == 4.0 and not meta["wq"]["rslora"]  # folded
    assert meta["wv"] == {"alpha": 8.0, "rank": 2, "rslora": False, "dropout": 0.0, "dtype": "float32"}
    assert arrays["w_down.lora_b"].shape == (2, 4, model.config.dim)
    for target, layer, scale in [("wq", 0, 8 / 4), ("wq", 1, 3 / 4), ("wv", 0, 8 / 2), ("wv", 1, 8 / 2),
                                 ("w_down", 1, 6 / 4)]:
        np.testing.assert_allclose(merged_delta(model, path, target)[layer], want_delta(tensors, target, layer, scale),
                                   rtol=1e-4, atol=1e-5, err_msg=f"{target} layer {layer}")
    assert not np.any(merged_delta(model, path, "w_down")[0])
    np.testing.assert_allclose(merged_delta(model, path, "head"), want_delta(tensors, "head", None, 8 / 3),
                               rtol=1e-4, atol=1e-5)


def test_a_bf16_peft_adapter_loads_in_bf16(model, tmp_path):
    tensors = {k: v.astype(ml_dtypes.bfloat16) for k, v in lora_tensors(model, 2, {("wq", 0): 4, ("wq", 1): 4}).items()}
    loaded = load_adapters(model, write_peft(tmp_path / "ad", tensors))
    leaf = loaded.layers.weight_var("wq").get_value()
    assert isinstance(leaf, LoRA) and leaf.lora_a.dtype == jnp.bfloat16 and leaf.lora_b.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(leaf.lora_a[1], np.float32),
                                  tensors[key("wq", 1, "A")].astype(np.float32).T)
    # Folded (an alpha per layer): B * scale is kept in float32, not rounded to bf16 a second time.
    folded = write_peft(tmp_path / "pattern", tensors, alpha_pattern={"layers.1.self_attn.q_proj": 3})
    loaded = load_adapters(model, folded)
    leaf = loaded.layers.weight_var("wq").get_value()
    assert leaf.lora_a.dtype == jnp.bfloat16 and leaf.lora_b.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(leaf.lora_b[1]), tensors[key("wq", 1, "B")].astype(np.float32).T * 0.75)


def test_keys_without_the_peftmodel_prefix_and_the_saved_head_copy(model, tmp_path):
    """transformers' own adapter saves drop `base_model.model.`; an lm_head adapter comes with PEFT's copy of
    the head (`lm_head.base_layer.weight`), which is checked against the model's head as jmem files are."""
    tensors = lora_tensors(model, 6, {("wq", 0): 4, ("wq", 1): 4, ("head", None): 4})
    plain = {k.removeprefix("base_model.model."): v for k, v in tensors.items()}
    head = np.ascontiguousarray(np.asarray(model.head.kernel.get_value()).T)  # safetensors writes memory order
    want = merged_delta(model, write_peft(tmp_path / "prefixed", tensors), "head")
    got = merged_delta(model, write_peft(tmp_path / "plain", {**plain, "lm_head.base_layer.weight": head}), "head")
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    other = np.random.default_rng(0).normal(size=head.shape).astype(np.float32)
    with pytest.raises(ValueError, match="was trained on another base model: its head weights do not match"):
        load_adapters(model, write_peft(tmp_path / "other", {**plain, "lm_head.base_layer.weight": other}))


def _refusal_cases(model):
    good = lora_tensors(model, 3, {("wq", 0): 4, ("wq", 1): 4})
    a0, b0 = key("wq", 0, "A"), key("wq", 0, "B")
    return [
        (dict(peft_type="IA3"), good, "peft_type='IA3'; accepted: 'LORA'"),
        (dict(use_dora=True), good,
         r"has use_dora=True; accepted: a plain LoRA adapter \(use_dora unset: jmem's LoRA holds no DoRA"),
        (dict(alora_invocation_tokens=[77, 3]), good,  # loaded as a plain LoRA, it acted on every token
         r"has alora_invocation_tokens=\[77, 3\]; accepted: a plain LoRA adapter \(.*aLoRA invocation tokens"),
        (dict(init_lora_weights="pissa_niter_4"), good, "init_lora_weights='pissa_niter_4'; accepted: an adapter "
         "for the unchanged base"),
        (dict(r=0), good, "has r=0; accepted: a positive integer"),
        (dict(r=16), good, "q_proj has rank 4, its config says 16"),  # scaled by 8/4 where PEFT scales by 8/16
        (dict(rank_pattern={"q_proj": 2}), good, "q_proj has rank 4, its config says 2"),
        (dict(use_rslora="false"), good, "use_rslora='false'; accepted: true or false"),
        (dict(lora_dropout="0.1"), good, r"lora_dropout='0.1'; accepted: a number in \[0, 1\)"),
        (dict(alpha_pattern={"q_proj": None}), good, "alpha_pattern=.*accepted: a map of module-name regexes to "
         "positive numbers"),  # was float(None)'s TypeError
        (dict(alpha_pattern={"q_proj(": 3}), good, "alpha_pattern="),  # was re.error
        ({}, {k: v.astype(np.int8) for k, v in good.items()}, "lora_A.weight holds int8 values; accepted: float32"),
        ({}, {**good, "base_model.model.model.embed_tokens.weight": np.ones((4, 4), np.float32)},
         "holds tensor 'base_model.model.model.embed_tokens.weight', which is no LoRA A/B of a Llama linear"),
        ({}, {**good, a0.replace("lora_A.weight", "lora_B.bias"): np.ones(4, np.float32)}, "no LoRA A/B"),
        ({}, {k: v for k, v in good.items() if k != b0}, "layers.0.self_attn.q_proj has only lora_A"),
        ({}, {**good, b0: good[b0][:, :3]}, r"has lora_A \(4, 64\) and lora_B \(64, 3\); accepted: lora_A \[r, in\]"),
        ({}, {**good, key("wq", 7, "A"): good[a0], key("wq", 7, "B"): good[b0]},
         "adapts layer 7, but the model has 2 layers"),
        ({}, {k.replace("q_proj", "qkv_proj"): v for k, v in good.items()},
         "adapts layers.0.self_attn.qkv_proj; accepted: the Llama linears"),
        ({}, {**good, a0: good[a0][:, :32]},
         r"q_proj has lora_A \(4, \d+\) and lora_B \(64, 4\), unlike the other layers' \[r, \d+\] / \[64, r\]"),
        ({}, {**good, b0: np.full_like(good[b0], np.nan)}, "wq.lora_b holds NaN or infinite values"),
    ]


@pytest.mark.parametrize("case", range(20))
def test_what_jmem_cannot_hold_is_one_error(model, tmp_path, case):
    config, tensors, message = _refusal_cases(model)[case]
    path = write_peft(tmp_path / "ad", tensors, **config)
    with pytest.raises(ValueError, match=message):
        load_adapters(model, path)


def test_an_unreadable_peft_directory_is_one_error(model, tmp_path):
    path = write_peft(tmp_path / "bin", None)
    (path / "adapter_model.bin").write_bytes(b"\x80\x02")
    with pytest.raises(ValueError, match=r"has no adapter_model.safetensors \(found: adapter_config.json, "
                                         r"adapter_model.bin\).*adapter_model.bin is not read"):
        read_adapters(path)
    path = write_peft(tmp_path / "json", None)
    (path / "adapter_config.json").write_text("{r: 4")
    with pytest.raises(ValueError, match="adapter_config.json is not readable JSON"):
        read_adapters(path)
    path = write_peft(tmp_path / "st", None)
    (path / "adapter_model.safetensors").write_bytes(b"junk")
    with pytest.raises(ValueError, match="adapter_model.safetensors is not a readable safetensors file"):
        read_adapters(path)


@pytest.mark.parametrize("runtime", [False, True])
def test_the_engine_serves_a_peft_adapter_beside_a_jmem_one(model, tmp_path, runtime):
    """Greedy continuations under a PEFT adapter (on wq and w_up of layer 0 only: the last layer padded)
    and a jmem .npz adapter, in one batch, equal each adapter merged into the model and run alone; the PEFT
    one given at the start or loaded while serving."""
    peft = write_peft(tmp_path / "peft", lora_tensors(model, 4, {("wq", 0): 4, ("w_up", 0): 4}))
    npz = random_adapter(model, tmp_path / "a.npz", 5, 8, ("wv",))
    config = EngineConfig(num_blocks=24, block_size=8, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64,
                          max_lora_rank=8, allow_runtime_lora=runtime)
    engine = Engine(model, ByteTokenizer(), config, lora_modules={"a": str(npz)} if runtime else
                    {"p": str(peft), "a": str(npz)})
    if runtime:
        engine.load_adapter("p", str(peft))
    prompts = [[5, 9, 77, 3], [200, 1, 2, 3, 4, 5], [17, 17, 17]]
    names = ["p", "a", "p"]
    outs = engine.generate(prompts, SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True), adapters=names)
    for name, prompt, out in zip(names, prompts, outs):
        want = generate_ids(merge(load_adapters(model, {"p": peft, "a": npz}[name])), [prompt], 5,
                            GenParams(temperature=0.0))[0]
        assert out.token_ids == want, name
    base = generate_ids(model, prompts[:1], 5, GenParams(temperature=0.0))[0]
    assert outs[0].token_ids != base  # the adapter changes the output, so the comparison shows something


def _hf_copy(model, torch, transformers):
    """transformers' LlamaForCausalLM with the tiny jmem model's weights ([out, in] = kernel transposed)."""
    c = model.config
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.dim, intermediate_size=c.ffn_dim, num_hidden_layers=c.n_layers,
        num_attention_heads=c.n_heads, num_key_value_heads=c.n_kv_heads, head_dim=c.head_dim,
        tie_word_embeddings=False, rope_theta=c.rope_base, rms_norm_eps=c.norm_eps)).float().eval()

    def t(x):
        return torch.tensor(np.ascontiguousarray(np.asarray(x.get_value())))

    weights = {"model.embed_tokens.weight": t(model.embed.embedding), "lm_head.weight": t(model.head.kernel).T,
               "model.norm.weight": t(model.norm.scale)}
    for i in range(c.n_layers):
        weights[f"model.layers.{i}.input_layernorm.weight"] = t(model.layers.attn_norm.scale)[i]
        weights[f"model.layers.{i}.post_attention_layernorm.weight"] = t(model.layers.mlp_norm.scale)[i]
        for target, module in HF.items():
            weights[f"model.layers.{i}.{module}.weight"] = t(model.layers.weight_var(target))[i].T
    missing, unexpected = hf.load_state_dict(weights, strict=False)
    assert not unexpected and all("rotary" in m for m in missing), (missing, unexpected)
    return hf


def _peft_logits(hf, torch, peft, cfg, ids, path):
    """The logits of `hf` with a random (nonzero) adapter of config `cfg`, which is saved to `path`."""
    torch.manual_seed(0)
    adapted = peft.get_peft_model(hf, peft.LoraConfig(**cfg))
    for name, p in adapted.named_parameters():
        if "lora_" in name:
            torch.nn.init.normal_(p, std=0.1)
    adapted.save_pretrained(str(path))
    with torch.no_grad():
        want = adapted(torch.tensor([ids])).logits[0].float().numpy()
    adapted.unload()  # the base model again, for the next adapter
    return want


@pytest.mark.parametrize("cfg", [
    dict(target_modules=["q_proj", "v_proj", "lm_head"], use_rslora=True, rank_pattern={"v_proj": 2},
         alpha_pattern={"lm_head": 4}),  # peft saves a copy of the head beside its adapter
    dict(target_modules="all-linear", alpha_pattern={"1.mlp.down_proj": 2}),
    dict(target_modules=["o_proj", "gate_proj", "down_proj"], layers_to_transform=[1]),
])
def test_peft_made_adapters_match_transformers_and_peft(model, tmp_path, cfg):
    """Adapters made and saved by peft itself on transformers' copy of the tiny model: jmem's logits with
    them equal transformers' with them."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    ids = [5, 9, 77, 3, 200, 1, 2, 17]
    hf = _hf_copy(model, torch, transformers)
    want = _peft_logits(hf, torch, peft, dict(r=4, lora_alpha=8, task_type="CAUSAL_LM", **cfg), ids, tmp_path / "ad")
    got = np.asarray(LM(load_adapters(model, tmp_path / "ad"), ByteTokenizer()).logits(jnp.asarray([ids])))[0]
    base = np.asarray(LM(model, ByteTokenizer()).logits(jnp.asarray([ids])))[0]
    assert np.abs(want - base).max() > 0.1  # the adapter changes the logits
    np.testing.assert_allclose(got, want, atol=1e-4)


@pytest.mark.slow
def test_smollm2_with_a_peft_adapter_matches_transformers_and_peft(tmp_path):
    """An adapter made and saved by peft on transformers' SmolLM2 (read from the same GGUF file): jmem's
    logits with it equal transformers' with it; rank/alpha patterns, rsLoRA and a layer subset included."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    from tests.helpers import smollm2

    lm = smollm2()
    gguf = packaged_model_path("smollm2-135m")
    hf = transformers.AutoModelForCausalLM.from_pretrained(os.path.dirname(gguf), gguf_file=os.path.basename(gguf),
                                                           dtype=torch.float32)
    ids = [1, 504, 3458, 282, 4649, 314, 253, 1345]
    configs = [dict(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                       "up_proj", "down_proj"]),
               dict(r=4, lora_alpha=8, use_rslora=True, target_modules=["q_proj", "v_proj", "down_proj"],
                    layers_to_transform=[0, 1, 5, 29], rank_pattern={"down_proj": 2},
                    alpha_pattern={"model.layers.1.self_attn.q_proj": 3})]
    for i, cfg in enumerate(configs):
        torch.manual_seed(i)
        adapted = peft.get_peft_model(hf, peft.LoraConfig(**cfg))
        for name, p in adapted.named_parameters():
            if "lora_B" in name:
                torch.nn.init.normal_(p, std=0.05)
        adapted.save_pretrained(str(tmp_path / f"ad{i}"))
        with torch.no_grad():
            want = adapted(torch.tensor([ids])).logits[0].numpy()
        hf = adapted.unload()  # the base model again, for the next adapter
        got = np.asarray(LM(load_adapters(lm.model, tmp_path / f"ad{i}"), lm.tokenizer).logits(jnp.asarray([ids])))[0]
        assert np.abs(want).max() > 1 and np.abs(got - want).max() < 1e-3, (i, np.abs(got - want).max())


# target, rank, alpha, rslora, dtype
ADAPTERS = [("wq", 4, 16.0, False, jnp.float32), ("wv", 8, 4.0, True, jnp.bfloat16),
            ("w_down", 4, 16.0, False, jnp.float32), ("head", 2, 3.0, False, jnp.float32)]


def _adapted(model):
    """The tiny model with adapters of different ranks, alphas and rsLoRA flags (bf16 on wv) and one on the head."""
    rng = np.random.default_rng(8)
    m = nnx.clone(model)
    for target, rank, alpha, rslora, dtype in ADAPTERS:
        var = m.head.kernel if target == "head" else m.layers.weight_var(target)
        *lead, n_in, n_out = var.get_value().shape
        a = jnp.asarray(rng.normal(size=(*lead, n_in, rank)) * n_in ** -0.5, dtype)
        b = jnp.asarray(rng.normal(size=(*lead, rank, n_out)) * 0.5, dtype)
        var.set_value(LoRA(var.get_value(), a, b, alpha, rslora=rslora))
    return m


def test_saved_peft_adapters_read_back_as_the_same_adapters(model, tmp_path):
    """save_peft_adapters then load_adapters: the same merged weights (one rsLoRA flag in PEFT's config: wv's
    alpha is rewritten to keep its scale), the same dtypes; refusals for what PEFT cannot hold."""
    from jmem.lora import save_peft_adapters

    adapted = _adapted(model)
    save_peft_adapters(adapted, tmp_path / "out")
    config = json.loads((tmp_path / "out" / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["rank_pattern"] == {"v_proj": 8, "lm_head": 2} and not config["use_rslora"]
    assert config["alpha_pattern"] == {"v_proj": pytest.approx(4.0 / math.sqrt(8) * 8), "lm_head": 3.0}
    loaded = load_adapters(model, tmp_path / "out")
    for target in ("wq", "wv", "w_down", "head"):
        np.testing.assert_allclose(base_weight(merge(loaded), target), base_weight(merge(adapted), target),
                                   rtol=1e-5, atol=1e-6, err_msg=target)
    assert loaded.layers.weight_var("wv").get_value().lora_a.dtype == jnp.bfloat16
    with pytest.raises(ValueError, match="the model has no LoRA adapters to save"):
        save_peft_adapters(model, tmp_path / "none")
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="PEFT adapter folder '.*file' is a file; accepted: a directory"):
        save_peft_adapters(adapted, tmp_path / "file")


def test_saved_peft_adapters_of_experts_are_refused(tmp_path):
    from jmem.lora import apply_lora, save_peft_adapters

    moe = Llama(LlamaConfig.tiny_moe(), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"adapters on moe\.\w+ have no PEFT layout; accepted: adapters on wq"):
        save_peft_adapters(apply_lora(moe, 2, targets=("wq", "moe.expert_up")), tmp_path / "out")


def test_peft_loads_saved_adapters_as_jmem_runs_them(model, tmp_path):
    """PEFT's own loader (PeftModel.from_pretrained on transformers' copy of the tiny model) reads
    save_peft_adapters' directory: the same logits as jmem with the adapters."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    from jmem.lora import save_peft_adapters

    ids = [5, 9, 77, 3, 200, 1, 2, 17]
    adapted = _adapted(model)
    save_peft_adapters(adapted, tmp_path / "out")
    hf = peft.PeftModel.from_pretrained(_hf_copy(model, torch, transformers), str(tmp_path / "out")).eval()
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0].float().numpy()
    got = np.asarray(LM(adapted, ByteTokenizer()).logits(jnp.asarray([ids])))[0]
    base = np.asarray(LM(model, ByteTokenizer()).logits(jnp.asarray([ids])))[0]
    assert np.abs(want - base).max() > 0.1
    np.testing.assert_allclose(got, want, atol=1e-4)  # measured 4e-6
