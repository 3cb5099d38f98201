"""Mixtral-style mixture-of-experts GGUF files: llama.cpp's tensor layout read into jmem's MoE block."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jmem
from jmem.io.gguf import GGUFError, permute_rotary
from jmem.io.gguf_writer import byte_tokenizer_metadata
from jmem.models import Llama, LlamaConfig

CFG = LlamaConfig.tiny_moe(moe_experts=4, moe_top_k=2, moe_dropless=True)


def _write_mixtral(path, model, *, expert_type=None, extra=None, feed_forward_length=None, per_expert=False):
    """`model`'s weights in the layout llama.cpp's converter writes for Mixtral: numpy [out, in] matrices,
    q/k rows permuted for its rotary, experts stacked first ([experts, ffn, embed] for gate and up,
    [experts, embed, ffn] for down), the router as `ffn_gate_inp` [experts, embed]. `expert_type`: the
    experts' block type (None: F32), or one per layer."""
    import gguf

    c = model.config
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(c.max_seq_len)
    w.add_embedding_length(c.dim)
    w.add_block_count(c.n_layers)
    w.add_feed_forward_length(feed_forward_length or c.ffn_dim)
    w.add_head_count(c.n_heads)
    w.add_head_count_kv(c.n_kv_heads)
    w.add_rope_freq_base(c.rope_base)
    w.add_layer_norm_rms_eps(c.norm_eps)
    w.add_expert_count(c.moe_experts)
    w.add_expert_used_count(c.moe_top_k)
    for key, value in (extra or {}).items():
        w.add_uint32(key, value)
    meta = byte_tokenizer_metadata()
    w.add_tokenizer_model(meta["tokenizer.ggml.model"])
    w.add_token_list(meta["tokenizer.ggml.tokens"])
    w.add_token_types(meta["tokenizer.ggml.token_type"])
    state = nnx.to_pure_dict(nnx.state(model))
    L = state["layers"]
    f32 = lambda a: np.ascontiguousarray(np.asarray(a, np.float32))  # noqa: E731
    w.add_tensor("token_embd.weight", f32(state["embed"]["embedding"]))
    w.add_tensor("output_norm.weight", f32(state["norm"]["scale"]))
    w.add_tensor("output.weight", f32(np.asarray(state["head"]["kernel"]).T))
    for i in range(c.n_layers):
        blk = f"blk.{i}."
        w.add_tensor(blk + "attn_norm.weight", f32(L["attn_norm"]["scale"][i]))
        w.add_tensor(blk + "ffn_norm.weight", f32(L["mlp_norm"]["scale"][i]))
        w.add_tensor(blk + "attn_q.weight", f32(permute_rotary(np.asarray(L["wq"]["kernel"][i]).T, c.n_heads)))
        w.add_tensor(blk + "attn_k.weight", f32(permute_rotary(np.asarray(L["wk"]["kernel"][i]).T, c.n_kv_heads)))
        w.add_tensor(blk + "attn_v.weight", f32(np.asarray(L["wv"]["kernel"][i]).T))
        w.add_tensor(blk + "attn_output.weight", f32(np.asarray(L["wo"]["kernel"][i]).T))
        w.add_tensor(blk + "ffn_gate_inp.weight", f32(np.asarray(L["moe"]["router"]["kernel"][i]).T))
        for name, ours in (("ffn_gate_exps", "expert_gate"), ("ffn_up_exps", "expert_up"),
                           ("ffn_down_exps", "expert_down")):
            experts = f32(np.swapaxes(np.asarray(L["moe"][ours][i]), -1, -2))  # [experts, out, in]
            kind = expert_type[i] if isinstance(expert_type, list) else expert_type

            def add(tensor_name, value):
                if kind is None:
                    w.add_tensor(tensor_name, np.ascontiguousarray(value))
                else:
                    qtype = gguf.GGMLQuantizationType[kind]
                    w.add_tensor(tensor_name, gguf.quants.quantize(value, qtype), raw_dtype=qtype)

            if per_expert:  # the layout before llama.cpp stacked the experts
                for e, matrix in enumerate(experts):
                    add(f"{blk}{name.removesuffix('_exps')}.{e}.weight", matrix)
            else:
                add(f"{blk}{name}.weight", experts)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def model():
    return Llama(CFG, rngs=nnx.Rngs(3))


def _logits(m, ids):
    return np.asarray(nnx.jit(lambda m, ids: m(ids)[0])(m, ids))


def test_a_mixtral_file_loads_as_the_moe_model_it_was_written_from(model, tmp_path, capsys):
    path = _write_mixtral(tmp_path / "moe.gguf", model)
    lm = jmem.load(str(path))
    c = lm.config
    assert (c.moe_experts, c.moe_top_k, c.moe_dropless, c.ffn_dim) == (4, 2, True, CFG.ffn_dim)
    got = nnx.to_pure_dict(nnx.state(lm.model))["layers"]["moe"]
    want = nnx.to_pure_dict(nnx.state(model))["layers"]["moe"]
    jax.tree.map(np.testing.assert_array_equal, got, want)
    ids = jnp.asarray(np.random.default_rng(0).integers(0, CFG.vocab_size, (2, 12)), jnp.int32)
    np.testing.assert_allclose(_logits(lm.model, ids), _logits(model, ids), rtol=1e-5, atol=1e-5)
    # Greedy generation through the KV cache (dropless routing, as the uncached forward here).
    assert lm.generate(["hi"], max_new_tokens=6) == jmem.LM(model, lm.tokenizer).generate(["hi"], max_new_tokens=6)
    from jmem.cli import info

    info(str(path))
    assert "ffn: 128  vocab: 259  experts: 4 (top 2)" in capsys.readouterr().out
    # packed=True keeps block types packed; F32 throughout here, so everything loads as float.
    np.testing.assert_allclose(_logits(jmem.load(str(path), packed=True).model, ids), _logits(model, ids),
                               rtol=1e-5, atol=1e-5)


def test_the_experts_width_may_have_its_own_key(model, tmp_path):
    """`expert_feed_forward_length` (written by newer converters) gives the experts' width."""
    lm = jmem.load(str(_write_mixtral(tmp_path / "e.gguf", model, extra={"llama.expert_feed_forward_length": 128},
                                      feed_forward_length=14336)))
    assert lm.config.ffn_dim == 128


def test_quantized_experts_decode_to_their_blocks(model, tmp_path):
    """Q8_0 experts: each expert's matrix decoded from its blocks (the file's values), close to the source."""
    lm = jmem.load(str(_write_mixtral(tmp_path / "q8.gguf", model, expert_type="Q8_0")))
    got = np.asarray(lm.model.layers.moe.expert_down.get_value())
    want = np.asarray(model.layers.moe.expert_down.get_value())
    assert got.shape == want.shape and not np.array_equal(got, want)
    np.testing.assert_allclose(got, want, atol=np.abs(want).max() / 100)


@pytest.mark.parametrize("extra, message", [
    ({"llama.expert_shared_count": 1}, "mixture-of-experts metadata llama.expert_shared_count is not supported"),
    ({"llama.expert_gating_func": 2}, "llama.expert_gating_func=2 is not supported; accepted: Mixtral-style"),
])
def test_other_moe_routings_are_refused_by_name(model, tmp_path, extra, message):
    path = _write_mixtral(tmp_path / "other.gguf", model, extra=extra)
    with pytest.raises(GGUFError, match=message):
        jmem.load(str(path))


def test_top_1_files_are_refused_by_name(tmp_path):
    """llama.cpp weighs a top-1 choice by 1 and jmem's top-1 gate by its router probability (other outputs)."""
    top1 = Llama(CFG.replace(moe_top_k=1), rngs=nnx.Rngs(3))
    with pytest.raises(GGUFError, match=r"llama.expert_used_count=1 is not supported \(llama.cpp weighs the one"):
        jmem.load(str(_write_mixtral(tmp_path / "top1.gguf", top1)))


def test_experts_stored_one_tensor_each_load_stacked(model, tmp_path):
    """Files converted before llama.cpp stacked the experts hold blk.N.ffn_gate.E.weight (llama.cpp still
    reads them): the same model as the stacked file (the error spoke of tensors beyond the block count)."""
    lm = jmem.load(str(_write_mixtral(tmp_path / "per_expert.gguf", model, per_expert=True)))
    jax.tree.map(np.testing.assert_array_equal, nnx.to_pure_dict(nnx.state(lm.model)),
                 nnx.to_pure_dict(nnx.state(model)))


def test_experts_stored_one_tensor_each_of_differing_shapes_are_named(model, tmp_path, monkeypatch):
    """One expert of another shape: a GGUFError naming it (numpy's stack error named no file or tensor)."""
    import gguf

    add_tensor = gguf.GGUFWriter.add_tensor

    def drop_a_row(self, name, array, *args, **kwargs):
        array = array[:-1] if name == "blk.0.ffn_gate.1.weight" else array
        return add_tensor(self, name, np.ascontiguousarray(array), *args, **kwargs)

    monkeypatch.setattr(gguf.GGUFWriter, "add_tensor", drop_a_row)
    path = _write_mixtral(tmp_path / "odd.gguf", model, per_expert=True)
    monkeypatch.undo()
    with pytest.raises(GGUFError, match=r"odd.gguf: tensor blk.0.ffn_gate.1.weight has shape \[\d+, \d+\], "
                                        r"expert 0's \[\d+, \d+\]"):
        jmem.load(str(path))


@pytest.mark.parametrize("expert_type, leaf, per_expert", [
    ("Q8_0", "GGMLWeight", False),
    (["Q8_0", "Q4_0"], "MixedGGMLWeight", False),  # block types differing across layers, as *_K_M files do
    ("Q8_0", "GGMLWeight", True),
])
def test_packed_experts_stay_in_their_blocks(model, tmp_path, expert_type, leaf, per_expert):
    """packed=True keeps quantized experts packed ([layers, experts, in, out], decoded one layer at a time
    inside the layer scan): the same logits and greedy text as the file decoded to float, in fewer bytes."""
    path = str(_write_mixtral(tmp_path / "q.gguf", model, expert_type=expert_type, per_expert=per_expert))
    flat, packed = jmem.load(path), jmem.load(path, packed=True)
    moe = packed.model.layers.moe
    for name in ("expert_gate", "expert_up", "expert_down"):
        value, want = getattr(moe, name).get_value(), getattr(flat.model.layers.moe, name).get_value()
        assert type(value).__name__ == leaf and tuple(value.shape) == tuple(want.shape)
        assert value.nbytes < want.nbytes / 3
        np.testing.assert_array_equal(np.asarray(value.__jmem_array__()), np.asarray(want))
    ids = jnp.asarray(np.random.default_rng(1).integers(0, CFG.vocab_size, (2, 12)), jnp.int32)
    np.testing.assert_allclose(_logits(packed.model, ids), _logits(flat.model, ids), rtol=1e-5, atol=1e-5)
    assert packed.generate(["hi"], max_new_tokens=6) == flat.generate(["hi"], max_new_tokens=6)


def _tensors_of(path):
    """{name: (GGML type name, shape, raw bytes)} as the `gguf` package reads the file."""
    import gguf

    return {t.name: (t.tensor_type.name, tuple(int(d) for d in t.shape), np.asarray(t.data).tobytes())
            for t in gguf.GGUFReader(str(path)).tensors}


def test_write_gguf_writes_mixtral_s_layout(model, tmp_path):
    """write_gguf of an MoE model: the tensors and expert fields llama.cpp's converter writes (checked against
    the independent writer above, byte for byte), loading back as the same model."""
    from jmem.io.gguf_writer import write_gguf

    ours, theirs = tmp_path / "ours.gguf", _write_mixtral(tmp_path / "theirs.gguf", model)
    write_gguf(str(ours), CFG, model, tokenizer_metadata=byte_tokenizer_metadata())
    assert _tensors_of(ours) == _tensors_of(theirs)
    lm = jmem.load(str(ours))
    assert (lm.config.moe_experts, lm.config.moe_top_k) == (4, 2)
    jax.tree.map(np.testing.assert_array_equal, nnx.to_pure_dict(nnx.state(lm.model)),
                 nnx.to_pure_dict(nnx.state(model)))


def test_a_quantized_moe_file_round_trips_its_blocks(model, tmp_path):
    """`jmem quantize --model FILE --method q8_0 --out X.gguf`: experts in Q8_0, the router kept in F32 (as
    llama.cpp keeps it); loaded packed and written again, every block tensor is the same bytes (the
    embedding and head load as float)."""
    from jmem.cli import main
    from jmem.io.gguf_writer import write_gguf

    src = _write_mixtral(tmp_path / "src.gguf", model)
    out = tmp_path / "q8.gguf"
    main(["quantize", "--model", str(src), "--method", "q8_0", "--out", str(out)])
    tensors = _tensors_of(out)
    assert tensors["blk.0.ffn_gate_inp.weight"][0] == "F32" and tensors["blk.1.ffn_down_exps.weight"][0] == "Q8_0"
    packed = jmem.load(str(out), packed=True)
    assert type(packed.model.layers.moe.expert_down.get_value()).__name__ == "GGMLWeight"
    again = tmp_path / "again.gguf"
    write_gguf(str(again), packed.config, packed.model, tokenizer_metadata=byte_tokenizer_metadata())
    blocks = lambda ts: {k: v for k, v in ts.items() if k.startswith("blk.")}  # noqa: E731
    assert blocks(_tensors_of(again)) == blocks(tensors)
    ids = jnp.asarray(np.random.default_rng(2).integers(0, CFG.vocab_size, (2, 12)), jnp.int32)
    np.testing.assert_allclose(_logits(packed.model, ids), _logits(jmem.load(str(out)).model, ids),
                               rtol=1e-5, atol=1e-5)


def test_write_gguf_refuses_top_1_moe(tmp_path):
    from jmem.io.gguf_writer import write_gguf

    top1 = Llama(CFG.replace(moe_top_k=1), rngs=nnx.Rngs(3))
    with pytest.raises(ValueError, match=r"moe_top_k=1: llama.cpp weighs the one chosen expert by 1"):
        write_gguf(str(tmp_path / "top1.gguf"), top1.config, top1, tokenizer_metadata=byte_tokenizer_metadata())
    assert not (tmp_path / "top1.gguf").exists()


def test_experts_whose_block_types_differ_by_layer_are_written_as_they_were(model, tmp_path):
    """A packed MixedGGMLWeight of experts (Q8_0 in layer 0, Q4_0 in layer 1) is written layer by layer in its
    own types: the same bytes as the file it came from."""
    from jmem.io.gguf_writer import write_gguf

    src = _write_mixtral(tmp_path / "mixed.gguf", model, expert_type=["Q8_0", "Q4_0"])
    packed = jmem.load(str(src), packed=True)
    out = tmp_path / "again.gguf"
    write_gguf(str(out), packed.config, packed.model, tokenizer_metadata=byte_tokenizer_metadata())
    blocks = lambda ts: {k: v for k, v in ts.items() if k.startswith("blk.")}  # noqa: E731
    assert blocks(_tensors_of(out)) == blocks(_tensors_of(src))
    assert _tensors_of(out)["blk.1.ffn_up_exps.weight"][0] == "Q4_0"


def test_the_router_stays_f32_and_the_label_follows_the_experts(model, tmp_path):
    """A pattern naming only the router is refused saying why; a file whose experts are Q8_0 and everything
    else F32 is labelled Q8_0 (most of its weights), not ALL_F32 (most of its matrices)."""
    import gguf

    from jmem.io.gguf_writer import write_gguf

    with pytest.raises(ValueError, match=r"match no matrix; blk.\*.ffn_gate_inp.weight names only the MoE "
                                         r"router \(ffn_gate_inp\), which is always F32"):
        write_gguf(str(tmp_path / "r.gguf"), CFG, model, tokenizer_metadata=byte_tokenizer_metadata(),
                   qtype_by_tensor={"blk.*.ffn_gate_inp.weight": "Q8_0"})
    path = tmp_path / "experts.gguf"
    write_gguf(str(path), CFG, model, tokenizer_metadata=byte_tokenizer_metadata(),
               qtype_by_tensor={"blk.*.ffn_*_exps.weight": "Q8_0"})
    label = int(gguf.GGUFReader(str(path)).fields["general.file_type"].parts[-1][0])
    assert label == gguf.LlamaFileType.MOSTLY_Q8_0
