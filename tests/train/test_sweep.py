"""`experiments/memory_sweep.py`: records with the documented keys; bad lists fail in one line."""

import json
import re

import jax
import pytest
from flax import nnx

from jmem.models import Llama, get_config
from jmem.train.sweep import RECORD_KEYS, parse_list
from tests.helpers import experiment


def _main(argv, capsys):
    rc = experiment("memory_sweep").main(argv)
    return rc, capsys.readouterr()


@pytest.mark.parametrize("text, items", [
    ("none, full", ["none", "full"]),
    ("query=device,mlp_up=offload", ["query=device,mlp_up=offload"]),  # one per-name remat spec, not two
    ("f32,p=bf16,c=bf16,o=f32,bf16", ["f32", "p=bf16,c=bf16,o=f32", "bf16"]),
    ("query=device;key=offload,full", ["query=device", "key=offload", "full"]),
])
def test_lists_keep_key_value_specs_whole(text, items):
    assert parse_list(text, "remat") == items


def test_one_combination_writes_json_table_and_chart(tmp_path, capsys):
    out, md, png = tmp_path / "s.json", tmp_path / "s.md", tmp_path / "s.png"
    rc, cap = _main(["--preset", "tiny", "--batch", "4", "--seq", "32", "--remat", "full", "--precision", "f32",
                     "--accum", "2", "--optimizer", "adafactor", "--out", str(out), "--md", str(md),
                     "--png", str(png)], capsys)
    assert rc == 0, cap.err
    (rec,) = json.loads(out.read_text())
    assert set(RECORD_KEYS) <= set(rec)
    assert (rec["remat"], rec["precision"], rec["accum"], rec["optimizer"]) == ("full", "f32", 2, "adafactor")
    assert rec["attention"] == "xla"  # the preset's implementation when --attention is not given
    assert rec["temp_bytes"] > 0 and rec["flops"] > 0
    assert rec["total_bytes"] >= rec["argument_bytes"] > rec["param_bytes"] > 0
    assert "| full | f32 | 2 | adafactor |" in md.read_text() and png.stat().st_size > 1000


def test_a_sweep_stopped_midway_keeps_what_it_compiled(tmp_path, capsys, monkeypatch):
    """The records are written after each compilation (a Ctrl-C in the 84th compile of the default grid
    kept nothing)."""
    import jmem.train.sweep as sweep_module

    compile_record, calls = sweep_module.compile_record, []

    def stop_at_the_second(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return compile_record(*args, **kwargs)

    monkeypatch.setattr(sweep_module, "compile_record", stop_at_the_second)
    out, md = tmp_path / "s.json", tmp_path / "s.md"
    with pytest.raises(KeyboardInterrupt):
        _main(["--preset", "tiny", "--batch", "4", "--seq", "32", "--remat", "none,full", "--precision", "f32",
               "--accum", "1", "--optimizer", "adamw", "--out", str(out), "--md", str(md),
               "--png", str(tmp_path / "s.png")], capsys)
    (rec,) = json.loads(out.read_text())
    assert rec["remat"] == "none" and "| none | f32 | 1 | adamw |" in md.read_text()


@pytest.mark.parametrize("argv, expected", [
    (["--remat", "none,bogus"], "unknown remat policy 'bogus'"),
    (["--precision", "f32,q8"], "precision 'q8'"),
    (["--accum", "3"], "--accum=3 does not divide batch=8"),
    (["--precision", "f32,p=f32,c=bf16,o=bf16"], "--precision='p=f32,c=bf16,o=bf16' asks for bfloat16 outputs"),
    (["--optimizer", "adamw,lion"], "--optimizer=lion: unknown optimizer; accepted: adamw,"),
    (["--target", "tpu:v5e"], "target 'tpu:v5e'"),
    (["--accum", "two"], "--accum 'two' is not a positive integer"),
    (["--attention", "flash"], "--attention=flash: unknown attention; accepted: auto,"),
    (["--mesh", "stage=2,data=4", "--accum", "1", "--pipeline-stages", "2", "--pipeline-schedule", "zb"],
     "unknown pipeline schedule 'zb'"),
    (["--microbatches", "0"], "--microbatches '0' is not a positive integer"),
    (["--batch", "0"], "--batch=0; accepted: an integer >= 1"),
    (["--batch", "-2"], "--batch=-2; accepted: an integer >= 1"),
    (["--seq", "0"], "--seq=0; accepted: an integer >= 1"),
    (["--seq", "-1"], "--seq=-1; accepted: an integer >= 1"),
    # XLA aborted the process (a failed check in its heap simulator, or an extent-product overflow).
    (["--preset", "tiny", "--seq", "10000000", "--batch", "2000"], "--batch=2000 --seq=10000000: the step's largest "
     "array would hold 8e+17 elements, beyond the 7.21e+16 XLA can compile; accepted: a smaller --batch or --seq"),
    (["--pipeline-stages", "0"], "--pipeline-stages 0; accepted: a positive integer"),
    # As train.py, a pipeline adds the stage axis to a mesh without one.
    (["--mesh", "data=4,fsdp=2", "--pipeline-stages", "2"], "--mesh=data=4,fsdp=2 (as stage=2,data=4,fsdp=2, the "
     "stage axis added): mesh stage=2,data=4,fsdp=2 needs 16 devices but there are 8"),
    (["--mesh", "stage=2,data=4;data=8", "--pipeline-stages", "2", "--accum", "1"], "--mesh=data=8 (as stage=2,data=8, the stage "
     "axis added): mesh stage=2,data=8 needs 16 devices"),
])
def test_bad_lists_are_one_line_before_compiling(argv, expected, capsys, tmp_path):
    outputs = [f"--{k}={tmp_path / 'new' / ('x.' + k.replace('out', 'json'))}" for k in ("out", "md", "png")]
    rc, cap = _main(argv + outputs, capsys)
    lines = cap.err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and expected in lines[0], cap.err
    assert list(tmp_path.iterdir()) == []  # no output, and no directory made for one


def _no_compile(*args, **kwargs):
    raise AssertionError("compiled before every value of every list was checked")


_TINY = {"--preset": "tiny", "--batch": "8", "--seq": "32", "--remat": "none", "--precision": "f32", "--accum": "1",
         "--optimizer": "adamw"}
_PIPE = {"--mesh": "stage=2,data=4", "--pipeline-stages": "2"}


@pytest.mark.parametrize("flags, expected", [
    ({"--batch": "2", "--accum": "1,3"}, "--accum=3 does not divide batch=2; accepted values: 1, 2"),
    ({**_PIPE, "--microbatches": "2,3"}, "--microbatches=3: --batch=8 split over the data-parallel size 4"),
    ({"--remat": "full,bogus"}, "--remat=bogus: unknown remat policy 'bogus'; accepted: none, full,"),
    ({"--precision": "f32,q8"}, "--precision=q8: precision 'q8'"),
    ({"--optimizer": "adamw,lion"}, "--optimizer=lion: unknown optimizer; accepted: adamw,"),
    ({"--mesh": "data=8", "--zero": "0,5"}, "--zero=5 is not a ZeRO stage; accepted: 0, 1, 2, 3"),
    ({**_PIPE, "--pipeline-schedule": "gpipe,zb"}, "--pipeline-schedule=zb: unknown pipeline schedule 'zb'; accepted"),
    ({"--mesh": "data=8;data=16"}, "--mesh=data=16: mesh data=16 needs 16 devices but there are 8"),
    ({"--mesh": "data=8;tensor=8"}, "--mesh=tensor=8: n_heads=4 is not divisible by mesh axes tensor of size 8"),
    ({**_PIPE, "--mesh": "stage=2,data=4;stage=4,data=2"}, "--mesh=stage=4,data=2 has stage=4 but --pipeline-stages=2"),
    ({"--mesh": "data=4,tensor=2;data=8", "--batch": "4"}, "--batch=4 must be divisible by the data-parallel size 8 x --accum 1"),
    # Without a pipeline these compiled the same step once per value.
    ({"--microbatches": "2,4"}, "--microbatches=2,4 needs --pipeline-stages > 1"),
    ({"--pipeline-schedule": "gpipe,1f1b"}, "--pipeline-schedule=gpipe,1f1b needs --pipeline-stages > 1"),
    ({"--rules": "length=tensor"}, "--rules length=tensor needs a mesh"),  # was ignored
    ({**_PIPE, "--rules": "layers=data"}, "--rules layers=data places 'layers' on data, but --pipeline-stages=2"),
])
def test_a_bad_value_late_in_a_list_fails_before_the_first_compile(flags, expected, monkeypatch, capsys, tmp_path):
    """Each list value (and each combination) is checked with the train step's checks before
    anything compiles, in one line naming the flag; the good combinations before it are not compiled
    first and then lost."""
    import jmem.train.sweep as sweep_mod

    monkeypatch.setattr(sweep_mod, "compile_record", _no_compile)
    argv = [x for kv in {**_TINY, **flags, "--out": str(tmp_path / "x.json")}.items() for x in kv]
    rc, cap = _main(argv, capsys)
    lines = cap.err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and lines[0].startswith(f"error: {expected}"), cap.err
    assert "accepted" in lines[0], lines[0]
    assert "compilations" not in cap.out and not (tmp_path / "x.json").exists()


@pytest.mark.parametrize("flags, expected", [
    ({"--mesh": "stage=2,data=4"}, "--mesh 'stage=2,data=4' has a stage axis but --pipeline-stages is 1"),
    ({**_PIPE, "--remat": "none,offload", "--pipeline-schedule": "1f1b"},
     "--remat offload with --pipeline-schedule 1f1b is not supported"),
    ({"--mesh": "stage=4,data=2", "--pipeline-stages": "4"}, "--pipeline-stages=4 must divide the 2 layers"),
    ({**_PIPE, "--preset": "tiny-moe"}, "--pipeline-stages with a mixture-of-experts model is not supported"),
    ({"--seq": "31", "--mesh": "data=8;data=2,fsdp=2,tensor=2", "--rules": "length=tensor"},
     "--seq=31: dim 1 (length) has size 31, not divisible by mesh axes tensor of size 2"),
])
def test_what_train_py_refuses_the_sweep_refuses_before_compiling(flags, expected, monkeypatch, capsys, tmp_path):
    """The sweep compiled these (or some of the combinations before a late failure) where train.py
    refuses them up front: the two now share the checks."""
    import jmem.train.sweep as sweep_mod

    monkeypatch.setattr(sweep_mod, "compile_record", _no_compile)
    argv = [x for kv in {**_TINY, **flags, "--out": str(tmp_path / "x.json")}.items() for x in kv]
    rc, cap = _main(argv, capsys)
    lines = cap.err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and lines[0].startswith(f"error: {expected}"), cap.err


def test_sweep_checks_every_combination_before_compiling(monkeypatch):
    """The library entry point too: microbatches=3 does not split batch 8 over data=4, found before
    the microbatches=2 combination is compiled."""
    import jmem.train.sweep as sweep_mod
    from jmem.models.config import PRESETS

    monkeypatch.setattr(sweep_mod, "compile_record", _no_compile)
    with pytest.raises(ValueError, match=r"^--microbatches=3: .*; accepted: --batch a multiple of 4 x 1 x 3 = 12$"):
        sweep_mod.sweep(PRESETS["tiny"](), batch=8, seq=32, remats=["none"], precisions=["f32"], accums=[1],
                        optimizers=["adamw"], meshes=["stage=2,data=4"], pipeline_stages=2, microbatches=[2, 3])
    # A pipeline's own rule given in --rules is taken as it is (it was "given twice", under --mesh).
    monkeypatch.setattr(sweep_mod, "compile_record", lambda mc, **kw: kw)
    [kw] = sweep_mod.sweep(PRESETS["tiny"](), batch=8, seq=32, remats=["none"], precisions=["f32"], accums=[1],
                           optimizers=["adamw"], meshes=["stage=2,data=4"], pipeline_stages=2, rules="layers=stage")
    assert kw["rules"] == "layers=stage"
    monkeypatch.setattr(sweep_mod, "compile_record", _no_compile)
    # Sizes and empty lists from Python (a ZeroDivisionError deep in the step, or no records and no word).
    one = dict(batch=8, seq=32, remats=["none"], precisions=["f32"], accums=[1], optimizers=["adamw"])
    for change, message in ((dict(batch=0), "--batch=0; accepted: an integer >= 1"),
                            (dict(seq=16.5), "--seq=16.5; accepted: an integer >= 1"),
                            (dict(remats=[]), "--remat: an empty list; accepted: at least one value"),
                            (dict(remats=["none", "full", "none"]),  # compiled twice; the table took the last
                             "--remat: none given more than once; accepted: each value once")):
        with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
            sweep_mod.sweep(PRESETS["tiny"](), **{**one, **change})


@pytest.mark.parametrize("flag", ["--out", "--md", "--png"])
def test_output_that_cannot_be_written_fails_before_compiling(flag, capsys, tmp_path):
    (tmp_path / "file").write_text("")  # a file where a directory would have to be
    bad = str(tmp_path / "file" / "sub" / f"x.{flag[2:]}")
    argv = ["--out", str(tmp_path / "x.json"), "--md", str(tmp_path / "x.md"), "--png", str(tmp_path / "x.png")]
    argv[argv.index(flag) + 1] = bad
    rc, cap = _main(argv, capsys)
    lines = cap.err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and f"{flag} '{bad}': cannot create directory" in lines[0], cap.err
    assert "compilations" not in cap.out  # nothing compiled


def _tiny_argv(tmp_path, png="x/s.png"):
    return ["--preset", "tiny", "--batch", "4", "--seq", "64", "--remat", "full", "--precision", "f32", "--accum", "1",
            "--optimizer", "adamw", "--out", str(tmp_path / "x" / "s.json"), "--md", str(tmp_path / "x" / "s.md"),
            "--png", str(tmp_path / png)]


def test_chart_format_matplotlib_cannot_write_fails_before_compiling(capsys, tmp_path):
    """--png's extension is checked with the flags (the same check as train.py's --plot), not by
    matplotlib after every compile and after --out and --md were written."""
    png = tmp_path / "x" / "s.txt"
    rc, cap = _main(_tiny_argv(tmp_path, "x/s.txt"), capsys)
    lines = cap.err.strip().splitlines()
    assert rc == 2 and len(lines) == 1, cap.err
    assert lines[0].startswith(f"error: --png '{png}': matplotlib cannot write '.txt' files; accepted: a file name "
                               "ending in .eps,") and ".png" in lines[0], cap.err
    assert "compilations" not in cap.out and list(tmp_path.iterdir()) == []  # nothing compiled, nothing written


def test_outputs_at_one_path_fail_before_compiling(capsys, tmp_path):
    """--out and --md at one path: the table overwrote the records, and the run said it wrote both."""
    argv = _tiny_argv(tmp_path)
    argv[argv.index("--md") + 1] = argv[argv.index("--out") + 1]
    rc, cap = _main(argv, capsys)
    lines = cap.err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("error: --out ") and "are one path" in lines[0]
    assert "compilations" not in cap.out and list(tmp_path.iterdir()) == []


def test_output_directory_without_write_permission_fails_before_compiling(monkeypatch, capsys, tmp_path):
    """A directory that exists but cannot be written into (permissions, a read-only file system) is
    refused with the flags. Simulated: the tests may run as root, which no mode bit stops."""
    import os

    readonly, access = tmp_path / "ro", os.access
    readonly.mkdir()
    monkeypatch.setattr(os, "access", lambda p, mode, **kw: os.fspath(p) != str(readonly) and access(p, mode, **kw))
    argv = _tiny_argv(tmp_path)
    argv[argv.index("--md") + 1] = str(readonly / "s.md")
    rc, cap = _main(argv, capsys)
    lines = cap.err.strip().splitlines()
    assert rc == 2 and len(lines) == 1, cap.err
    assert lines[0] == f"error: --md '{readonly / 's.md'}': '{readonly}' is not writable; accepted: a writable path"
    assert "compilations" not in cap.out and not (tmp_path / "x" / "s.json").exists()


def test_pipeline_schedules_are_swept_on_a_stage_mesh(tmp_path, capsys):
    out = tmp_path / "p.json"
    rc, cap = _main(["--preset", "tiny", "--mesh", "stage=2,data=4", "--pipeline-stages", "2", "--microbatches", "4",
                     "--pipeline-schedule", "gpipe,1f1b", "--batch", "32", "--seq", "32", "--remat", "full",
                     "--precision", "f32", "--accum", "1,2", "--optimizer", "adamw", "--out", str(out),
                     "--md", str(tmp_path / "p.md"), "--png", str(tmp_path / "p.png"), "--rules", "kv_heads=none"],
                    capsys)
    assert rc == 0, cap.err
    gpipe, gpipe_accum, one_f_one_b, one_f_one_b_accum = json.loads(out.read_text())
    # The busiest stage's matmuls per step, as train.py counts them, whatever the accumulation (None before).
    assert one_f_one_b_accum["matmul_flops"] == one_f_one_b["matmul_flops"] > 0
    assert gpipe_accum["accum"] == 2
    assert gpipe["rules"] == "layers=stage,kv_heads=none"
    assert "rules kv_heads=none]" in (tmp_path / "p.md").read_text()  # the flag as given
    # Each stage's devices hold their half of the layers, as in train.py (the sweep compiled every device
    # with the whole stack).
    model = nnx.eval_shape(lambda: Llama(get_config("tiny"), rngs=nnx.Rngs(0)))
    layers = nnx.to_pure_dict(nnx.state(model, nnx.Param))["layers"]
    layer_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(layers))
    for rec in (gpipe, one_f_one_b):
        assert rec["param_bytes_per_device"] == rec["param_bytes"] - layer_bytes // 2
    assert gpipe["pipeline"] == "2 stages x 4 microbatches, gpipe"
    assert one_f_one_b["pipeline"] == "2 stages x 4 microbatches, 1f1b"
    assert one_f_one_b["temp_bytes"] < gpipe["temp_bytes"]  # at most S stage inputs held, not M
