"""`jmem quantize`, run as a user would, on the tiny model."""

import os
import subprocess
import sys

import numpy as np
import pytest

import jmem
from tests.helpers import refuse_load


def _quantize(*args):
    code = "import sys; from jmem.cli import main; main(sys.argv[1:])"
    return subprocess.run([sys.executable, "-c", code, "quantize", *args], capture_output=True, text=True,
                          timeout=600)


@pytest.mark.slow
def test_gguf_method_and_rtn_written_and_loadable(tmp_path):
    ids = np.arange(1, 17, dtype=np.int32)[None]
    float_logits = np.asarray(jmem.load("tiny").logits(ids))
    errors = {}
    for method, bits in (("q8_0", "8"), ("rtn", "8"), ("rtn", "2")):
        out = tmp_path / f"{method}{bits}.gguf"
        flags = [] if method == "q8_0" else ["--bits", bits, "--group-size", "32"]  # Q8_0 fixes its own layout
        r = _quantize("--model", "tiny", "--method", method, *flags, "--out", str(out))
        assert r.returncode == 0, r.stderr
        assert f"wrote {out}" in r.stdout
        logits = np.asarray(jmem.load(str(out)).logits(ids))
        errors[method + bits] = np.abs(logits - float_logits).mean() / float_logits.std()
    assert 0 < errors["q8_08"] < 0.05 and 0 < errors["rtn8"] < 0.05, errors
    assert errors["rtn2"] > 3 * max(errors["q8_08"], errors["rtn8"]), errors


def test_bad_input_one_line(tmp_path, capsys):
    from jmem.cli import main

    for args in (["--method", "q9_9", "--out", str(tmp_path / "a.gguf")],
                 ["--method", "rtn", "--out", str(tmp_path / "a.bin")],
                 ["--method", "rtn", "--bits", "5", "--out", str(tmp_path / "a.gguf")]):
        with pytest.raises(SystemExit) as exc:
            main(["quantize", "--model", "tiny", *args])
        err = capsys.readouterr().err
        assert exc.value.code == 2 and err.startswith("jmem quantize: error: ") and err.count("\n") == 1, err
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("args, expected", [
    (["--method", "gptq", "--calibration-windows", "0"], "--calibration-windows 0; accepted: a positive integer"),
    (["--method", "awq", "--calibration-windows", "-3"], "--calibration-windows -3; accepted: a positive integer"),
    (["--method", "gptq", "--calibration", "/nonexist"], "--calibration '/nonexist': no such file"),
    (["--method", "rtn", "--group-size", "0"], "--group-size 0; accepted: a positive number"),
    (["--method", "rtn", "--group-size", "7"],
     "--group-size 7 is not a multiple of 8 (4-bit codes are packed 8 rows at a time, so groups are multiples of 8); "
     "accepted: a multiple of 8 (e.g. 32, 64, 128), --group-size -1 for per channel, or --bits 8 (any size)"),
    (["--method", "gptq", "--bits", "3", "--group-size", "20"], "--group-size 20 is not a multiple of 8 (3-bit codes"),
    # A flag the method does not read is refused, not ignored.
    (["--method", "q4_0", "--bits", "8"], "--bits=8 does not apply to --method q4_0 (a GGUF block type fixes its "
                                          "bits); accepted: --bits only with --method rtn / int8 / nf4 / fp8"),
    (["--method", "rtn", "--calibration", "/nonexistent.txt"],
     "--calibration=/nonexistent.txt does not apply to --method rtn (it does not calibrate); accepted: "
     "--calibration only with --method gptq / awq"),
    (["--method", "q4_k", "--calibration", "/nonexistent.txt"], "does not apply to --method q4_k"),
    (["--method", "nf4", "--calibration-windows", "4"], "--calibration-windows=4 does not apply to --method nf4"),
    (["--method", "rtn", "--calibration-seq-len", "64"], "--calibration-seq-len=64 does not apply to --method rtn"),
    (["--method", "awq", "--calibration-seq-len", "0"], "--calibration-seq-len 0; accepted: a positive integer"),
    (["--method", "int8", "--group-size", "32"], "--group-size=32 does not apply to --method int8"),
    (["--method", "q8_0", "--group-size", "32"], "--group-size=32 does not apply to --method q8_0"),
    (["--method", "awq", "--act-order"], "--act-order does not apply to --method awq (only gptq orders columns)"),
    (["--method", "fp8", "--no-symmetric"], "--no-symmetric does not apply to --method fp8"),
    (["--method", "q4_0", "--store-type", "Q8_0"], "--store-type=Q8_0 does not apply to --method q4_0"),
    (["--method", "f16", "--store-type", "Q8_0"], "--store-type=Q8_0 does not apply to --method f16"),
    (["--method", "bf16", "--bits", "8"], "--bits=8 does not apply to --method bf16"),
    (["--method", "nf4", "--bits", "8"], "--bits=8 is not supported by --method nf4; accepted: 4"),
    (["--method", "rtn", "--store-type", "Q9"], "--store-type 'Q9': unsupported GGML tensor type 'Q9'"),
    (["--method", "rtn", "--model", "nosuch"], "--model 'nosuch' is neither a file nor a directory"),
])
def test_flags_checked_before_the_model_loads(args, expected, tmp_path, monkeypatch, capsys):
    from jmem.cli import main

    monkeypatch.setattr(jmem, "load", refuse_load)
    with pytest.raises(SystemExit) as exc:
        main(["quantize", "--model", "tiny", *args, "--out", str(tmp_path / "a.gguf")])
    err = capsys.readouterr().err.strip()
    assert exc.value.code == 2 and "\n" not in err and expected in err, err
    assert not list(tmp_path.iterdir())


def test_calibration_windows_fit_a_short_context(tmp_path, capsys):
    """A model of 128 tokens of context: its windows default to 128 tokens (512 was refused, naming a
    setting the command line lacked); a longer --calibration-seq-len is refused before any work."""
    from flax import nnx

    from jmem.cli import main
    from jmem.io.gguf_writer import byte_tokenizer_metadata, write_gguf
    from jmem.models import Llama, LlamaConfig

    cfg = LlamaConfig.tiny(n_layers=1, max_seq_len=128)
    src = str(tmp_path / "short.gguf")
    write_gguf(src, cfg, Llama(cfg, rngs=nnx.Rngs(0)), tokenizer_metadata=byte_tokenizer_metadata())
    out = tmp_path / "awq"
    main(["quantize", "--model", src, "--method", "awq", "--calibration-windows", "2", "--out", str(out)])
    assert f"wrote {out}" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exc:
        main(["quantize", "--model", src, "--method", "gptq", "--calibration-seq-len", "200",
              "--out", str(tmp_path / "gptq")])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "--calibration-seq-len 200 exceeds the model's context of 128 tokens; " \
        "accepted: 1..128" in err, err
    assert not (tmp_path / "gptq").exists()


def test_k_quant_falls_back_where_the_super_block_does_not_fit(tmp_path, capsys):
    """Every row of the tiny model (64, 128) is shorter than Q4_K's 256: llama.cpp's Q5_0 is written, and said."""
    from jmem.io.gguf import read_gguf
    from jmem.cli import main

    out = tmp_path / "q4k.gguf"
    main(["quantize", "--model", "tiny", "--method", "q4_k", "--out", str(out)])
    printed = capsys.readouterr().out
    assert ("Q4_K: row length 64 is not a multiple of its block size 256; stored as Q5_0 (llama.cpp's fallback): "
            "token_embd.weight, blk.*.attn_q.weight") in printed, printed
    assert "row length 128 is not a multiple of its block size 256; stored as Q5_0" in printed
    assert "output.weight (the output head): stored as Q8_0, as llama.cpp keeps the head at Q6_K" in printed
    types = {name: t.qtype for name, t in read_gguf(str(out)).tensors.items()}
    assert types["blk.0.ffn_down.weight"] == types["token_embd.weight"] == "Q5_0"  # tiny's head is untied
    assert types["output.weight"] == "Q8_0"
    ids = np.arange(1, 17, dtype=np.int32)[None]
    float_logits = np.asarray(jmem.load("tiny").logits(ids))
    logits = np.asarray(jmem.load(str(out)).logits(ids))
    assert 0 < np.abs(logits - float_logits).mean() / float_logits.std() < 0.2
    # Q2_K falls back to IQ4_NL (current llama.cpp), which also reads back.
    out = tmp_path / "q2k.gguf"
    main(["quantize", "--model", "tiny", "--method", "q2_k", "--out", str(out)])
    assert "stored as IQ4_NL (llama.cpp's fallback)" in capsys.readouterr().out
    assert {t.qtype for name, t in read_gguf(str(out)).tensors.items() if name.startswith("blk.") and "norm" not in name} \
        == {"IQ4_NL"}
    logits = np.asarray(jmem.load(str(out)).logits(ids))
    assert 0 < np.abs(logits - float_logits).mean() / float_logits.std() < 0.2


def test_legacy_block_type_that_fits_no_row_names_the_methods_that_fall_back(tmp_path, capsys):
    """A width of 72 fits no 32-weight block: Q4_0 has no fallback (as in llama.cpp), and the advice names the
    methods that have one, as the command line has no per-tensor type."""
    from flax import nnx

    from jmem.cli import main
    from jmem.io.gguf_writer import byte_tokenizer_metadata, write_gguf
    from jmem.models import Llama, LlamaConfig

    cfg = LlamaConfig.tiny(n_layers=1).replace(dim=72, n_heads=4, n_kv_heads=2, head_dim=18, ffn_dim=96)
    write_gguf(tmp_path / "d72.gguf", cfg, Llama(cfg, rngs=nnx.Rngs(0)), tokenizer_metadata=byte_tokenizer_metadata())
    with pytest.raises(SystemExit):
        main(["quantize", "--model", str(tmp_path / "d72.gguf"), "--method", "q4_0", "--out", str(tmp_path / "q.gguf")])
    assert ("token_embd.weight: row length 72 is not a multiple of the Q4_0 block size 32; accepted: a k-quant "
            "--method (q2_k .. q6_k), which falls back per tensor") in capsys.readouterr().err
    main(["quantize", "--model", str(tmp_path / "d72.gguf"), "--method", "q4_k", "--out", str(tmp_path / "q.gguf")])
    assert jmem.load(str(tmp_path / "q.gguf")).config.dim == 72


@pytest.mark.parametrize("method, head", [("q4_0", "Q6_K"), ("q8_0", "Q8_0"), ("q4_k", "Q6_K")])
def test_a_tied_head_is_stored_as_llama_cpp_stores_it(method, head, tmp_path, capsys):
    """small ties its head to the 256-wide token embedding: that matrix is the output head, which llama.cpp
    keeps at Q6_K (it was written in the asked type, 4 bits for q4_0)."""
    from jmem.io.gguf import read_gguf
    from jmem.cli import main

    out = tmp_path / f"{method}.gguf"
    main(["quantize", "--model", "small", "--method", method, "--out", str(out)])
    types = {name: t.qtype for name, t in read_gguf(str(out)).tensors.items()}
    assert types["token_embd.weight"] == head and "output.weight" not in types
    assert types["blk.0.attn_q.weight"] == method.upper()


def test_store_type_k_quant_falls_back_where_the_super_block_does_not_fit(tmp_path, capsys):
    """--store-type Q4_K takes the same llama.cpp fallback as --method q4_k (SmolLM2's 576-wide rows need it)."""
    from jmem.io.gguf import read_gguf
    from jmem.cli import main

    out = tmp_path / "rtn-q4k.gguf"
    main(["quantize", "--model", "tiny", "--method", "rtn", "--bits", "4", "--group-size", "32", "--store-type", "Q4_K",
          "--out", str(out)])
    printed = capsys.readouterr().out
    assert "Q4_K: row length 64 is not a multiple of its block size 256; stored as Q5_0 (llama.cpp's fallback)" in printed
    types = {n: t.qtype for n, t in read_gguf(str(out)).tensors.items() if "norm" not in n}
    assert types.pop("output.weight") == "Q8_0" and set(types.values()) == {"Q5_0"}  # the head: as llama.cpp


def test_gguf_source_keeps_its_general_metadata(tmp_path, capsys):
    """As llama.cpp's quantize: the source's general.* fields survive; only general.file_type (and the
    quantization version) say what changed."""
    import gguf

    from jmem.cli import main
    from jmem.io.gguf_writer import byte_tokenizer_metadata, write_gguf

    lm = jmem.load("tiny")
    general = {"general.name": "Smollm2 135M 8k", "general.license": "apache-2.0", "general.languages": ["en"],
               "general.organization": "HuggingFaceTB", "general.basename": "smollm2", "general.type": "model"}
    src, out = tmp_path / "src.gguf", tmp_path / "q8.gguf"
    write_gguf(src, lm.config, lm.model, tokenizer_metadata=byte_tokenizer_metadata(), general_metadata=general)
    main(["quantize", "--model", str(src), "--method", "q8_0", "--out", str(out)])
    capsys.readouterr()
    before, after = ({k: f.contents() for k, f in gguf.GGUFReader(p).fields.items() if k.startswith("general.")}
                     for p in (src, out))
    assert after == {**before, "general.file_type": int(gguf.LlamaFileType.MOSTLY_Q8_0),
                     "general.quantization_version": gguf.GGML_QUANT_VERSION}
    # A quantized model directory records them too (tests/train/test_save.py: a trained model's, into a GGUF).
    main(["quantize", "--model", str(src), "--method", "int8", "--out", str(tmp_path / "dir")])
    capsys.readouterr()
    assert jmem.load(str(tmp_path / "dir")).source.metadata == general


@pytest.mark.parametrize("method, dtype", [("f32", np.float32), ("f16", np.float16), ("bf16", "bfloat16")])
def test_float_types_convert_every_matrix(method, dtype, tmp_path, capsys):
    """--method f32/f16/bf16: no quantization, every matrix stored in that float type (norms in F32), equal to
    the source's weights rounded to it."""
    import gguf
    import jax.numpy as jnp
    from flax import nnx

    from jmem.cli import main
    from jmem.io.gguf import llama_weights, read_gguf

    out = tmp_path / f"{method}.gguf"
    main(["quantize", "--model", "tiny", "--method", method, "--out", str(out)])
    assert f"wrote {out}" in capsys.readouterr().out
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(out).tensors}
    assert {t for n, t in types.items() if "norm" not in n} == {method.upper()}
    assert {t for n, t in types.items() if "norm" in n} == {"F32"}
    lm = jmem.load("tiny")
    read = llama_weights(read_gguf(out), lm.config)
    source = {".".join(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(nnx.state(lm.model))}
    for name in ("layers.wq.kernel", "layers.w_down.kernel", "embed.embedding"):
        expected = np.asarray(jnp.asarray(source[name]).astype(dtype).astype(jnp.float32))
        np.testing.assert_array_equal(np.asarray(read[name]), expected)


def test_float_type_into_a_directory_is_refused(tmp_path, capsys):
    from jmem.cli import main

    with pytest.raises(SystemExit):
        main(["quantize", "--model", "tiny", "--method", "f16", "--out", str(tmp_path / "d")])
    assert "--method f16 writes a .gguf file; accepted with --out PATH.gguf" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


@pytest.mark.slow
def test_q4_k_on_smollm2_writes_a_file_that_loads(tmp_path, capsys):
    from tests.helpers import smollm2

    lm = smollm2()  # skips when the package is absent
    from jmem.cli import main

    out = tmp_path / "smollm2-q4k.gguf"
    main(["quantize", "--method", "q4_k", "--out", str(out)])
    printed = capsys.readouterr().out
    assert "Q4_K: row length 576 is not a multiple of its block size 256; stored as Q5_0" in printed, printed
    assert "Q4_K x30" in printed  # ffn_down (row length 1536) keeps Q4_K
    q = jmem.load(str(out))
    ids = np.asarray(lm.tokenizer.encode("The capital of France is"), np.int32)[None]
    ref, got = np.asarray(lm.logits(ids)), np.asarray(q.logits(ids))
    assert (ref.argmax(-1) == got.argmax(-1)).mean() >= 0.8


@pytest.mark.parametrize("args", [
    ["--model", "nosuch"],                                   # fails at load
    ["--model", "tiny", "--method", "rtn", "--group-size", "24"],  # fails after loading
])
@pytest.mark.parametrize("out", ["q/model-dir", "q/model.gguf", "empty"])
def test_failed_run_leaves_nothing_behind(args, out, tmp_path, capsys):
    """A failed run removes the --out it created (and its new parent directories); an empty --out stays empty."""
    from jmem.cli import main

    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit) as exc:
        main(["quantize", *args, "--out", str(tmp_path / out)])
    err = capsys.readouterr().err.strip()
    assert exc.value.code == 2 and "\n" not in err, err
    assert [p.name for p in tmp_path.iterdir()] == ["empty"] and not list((tmp_path / "empty").iterdir())


@pytest.mark.parametrize("requested, recorded, shown", [
    (48, 32, "group_size=32,"),  # 48 divides neither 64 nor 128: 32 everywhere
    (128, {"wq": 64, "wk": 64, "wv": 64, "wo": 64, "w_gate": 64, "w_up": 64, "w_down": 128},
     "group_size=64 (128 for w_down),"),  # 128 divides only w_down's input (128), not the width 64
])
def test_substituted_group_size_is_recorded_as_used(requested, recorded, shown, tmp_path, capsys):
    import json

    from jmem.cli import main
    from jmem.quant.api import group_sizes
    from jmem.quant.saved import MANIFEST

    out = tmp_path / "q"
    main(["quantize", "--model", "tiny", "--method", "rtn", "--group-size", str(requested), "--out", str(out)])
    assert "does not divide input dimension 64 (wq, wk, wv, wo, w_gate, w_up): using group size" in \
        capsys.readouterr().out
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["quantization"]["group_size"] == recorded
    used = group_sizes(jmem.load(str(out)).model)
    assert used == (recorded if isinstance(recorded, dict) else dict.fromkeys(used, recorded))
    main(["info", str(out)])
    assert shown in capsys.readouterr().out


def test_default_group_size_is_the_librarys():
    """`jmem quantize` without --group-size groups as `jmem.quant.quantize` and eval_quant.py do (128)."""
    import inspect

    from jmem.quant.api import quantize
    from jmem.quant.cli import QuantizeArgs

    assert QuantizeArgs(out="x.gguf").group_size == inspect.signature(quantize).parameters["group_size"].default == 128


def test_group_size_that_fits_no_matrix_is_said_in_flags(tmp_path, capsys):
    """24 is a multiple of 8 but divides neither 64 nor has a multiple of 32 below it that does: the error names
    the flag and its per-channel value (-1), not the library's `group_size=` / None."""
    from jmem.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["quantize", "--model", "tiny", "--method", "rtn", "--group-size", "24", "--out", str(tmp_path / "q")])
    err = capsys.readouterr().err.strip()
    assert exc.value.code == 2 and "\n" not in err, err
    assert err == ("jmem quantize: error: --group-size 24 does not fit wq: it does not divide the input dimension 64, "
                   "nor does any multiple of 32 below it; accepted: a size that divides 64 or has a multiple of 32 "
                   "below it that does (e.g. 8, 16, 32, 64), or --group-size -1 for per channel"), err
    assert not list(tmp_path.iterdir())


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux /proc (no file can be created there)")
def test_unwritable_gguf_out_is_refused_before_the_model_loads(tmp_path, monkeypatch, capsys):
    from jmem.cli import main

    monkeypatch.setattr(jmem, "load", refuse_load)
    with pytest.raises(SystemExit) as exc:
        main(["quantize", "--model", "tiny", "--method", "rtn", "--out", "/proc/x.gguf"])
    err = capsys.readouterr().err.strip()
    assert exc.value.code == 2 and err == ("jmem quantize: error: --out '/proc/x.gguf': cannot create the file "
                                           "(No such file or directory); accepted: a writable path"), err


def test_file_type_names_the_requested_type(tmp_path, capsys):
    """As llama.cpp: general.file_type is the type asked for, even where every matrix of tiny falls back (Q4_K ->
    Q5_0); Q4_K's file type is the _S preset (one type throughout), not _M (which widens attn_v / ffn_down)."""
    import gguf

    from jmem.cli import main

    def file_type(path):
        return gguf.LlamaFileType(gguf.GGUFReader(path).fields["general.file_type"].contents())

    out = tmp_path / "q4k.gguf"
    main(["quantize", "--model", "tiny", "--method", "q4_k", "--out", str(out)])
    assert file_type(out) == gguf.LlamaFileType.MOSTLY_Q4_K_S
    out = tmp_path / "rtn-q3k.gguf"
    main(["quantize", "--model", "tiny", "--method", "rtn", "--group-size", "32", "--store-type", "Q3_K",
          "--out", str(out)])
    assert file_type(out) == gguf.LlamaFileType.MOSTLY_Q3_K_S
    capsys.readouterr()


def test_a_capacity_routed_moe_model_written_to_gguf_says_it_loads_dropless(tmp_path, capsys):
    """GGUF has no expert-capacity field: the file loads dropless, so a model whose full-sequence forward drops
    tokens past its capacity computes other logits there; the command says so instead of converting silently."""
    from jmem.cli import main

    main(["quantize", "--model", "tiny-moe", "--method", "f32", "--out", str(tmp_path / "moe.gguf")])
    assert "note: a GGUF file records no expert capacity and loads routing every token" in capsys.readouterr().out
    assert jmem.load("tiny-moe").config.moe_dropless is False
    assert jmem.load(str(tmp_path / "moe.gguf")).config.moe_dropless is True
