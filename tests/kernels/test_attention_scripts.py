"""`experiments/eval_sparse_attention.py` and `experiments/bench_attention.py`: bad flags are one `error:` line
and exit status 2, before any model load or benchmark; `--quick` keeps flags given explicitly."""

import pytest

import jmem
from tests.helpers import experiment, refuse_load


@pytest.fixture(scope="module")
def sparse():
    return experiment("eval_sparse_attention")


@pytest.fixture(scope="module")
def bench():
    return experiment("bench_attention")


@pytest.mark.parametrize("argv, expected", [
    (["--text", "/nonexist"], "--text '/nonexist': no such file"),
    (["--seq", "0"], "--seq 0; accepted: an integer in 2..1048576 (and within the model's context)"),
    (["--seq", "1"], "--seq 1; accepted: an integer in 2..1048576"),
    (["--seq", "100000000"], "--seq 100000000; accepted: an integer in 2..1048576"),  # was a 568 GiB tile map
    (["--window", "0"], "--window 0; accepted: an integer >= 1"),
    (["--chunks", "-1"], "--chunks -1; accepted: an integer >= 1"),
    (["--impl", "foo"], "--impl 'foo'; accepted: auto, pallas, reference"),
    (["--seq", "64", "--num-global", "100"], "--num-global 100 is larger than --seq 64"),
    (["--seq", "32", "--bigbird-block", "64"], "--bigbird-block 64 is larger than --seq 32; accepted: 1..32"),
    (["--seq", "128", "--bigbird-block", "32", "--num-random", "4"],
     "--num-random 4 covers all 4 key blocks of --seq 128 (--bigbird-block 32); accepted: 0..3"),
    (["--out", ""], "--out '' is empty; accepted: a file path"),  # an empty path is not "no output file"
    # Read from the model's header before the masks' tile maps (minutes at --seq 100000) and the model.
    (["--seq", "600"], "error: --seq 600 exceeds the context of 'tiny' (512 tokens); accepted: 2..512"),
])
def test_sparse_eval_bad_flags(sparse, argv, expected, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(jmem, "load", refuse_load)
    argv = ["--model", "tiny", *argv]
    rc = sparse.main(argv if "--out" in argv else [*argv, "--out", str(tmp_path / "s.json")])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.startswith("error: ") and "\n" not in err and expected in err, err


@pytest.mark.parametrize("argv, expected", [
    (["--samples", "0"], "--samples 0; accepted: a positive integer"),
    (["--kv-heads", "3", "--q-heads", "4"], "--q-heads 4 is not a multiple of --kv-heads 3"),
    (["--head-dim", "0"], "--head-dim 0; accepted: a positive integer"),
    (["--context", "100", "--page-size", "16"], "--context 100 is not a multiple of --page-size 16"),
    (["--warmup", "-1"], "--warmup -1; accepted: a non-negative integer"),
    # --quick sizes only the flags left unset, so an explicit bad value is still refused.
    (["--quick", "--samples", "0", "--kv-heads", "3"], "--samples 0; accepted: a positive integer"),
    (["--quick", "--kv-heads", "3"], "--q-heads 4 is not a multiple of --kv-heads 3"),
    (["--out", ""], "--out '' is empty; accepted: a file path"),  # an empty path is not "no output file"
    (["--flash-tiles", "128x64"], "--flash-tiles entry '128x64'; accepted: BQxBKxWARPS"),
    (["--flash-tiles", "128x64x8,96x64x4"], "--flash-tiles entry '96x64x4'; accepted: tile sizes powers of two"),
    (["--flash-tiles", "128x64x3"], "--flash-tiles entry '128x64x3'; accepted: tile sizes powers of two >= 16, warps"),
    # Inputs beyond memory failed midway, after the first rows, with a traceback.
    (["--quick", "--context", "1000000000000"], "--batch x --context x --kv-heads x --head-dim: the inputs need "
                                                "732421875 MiB and "),
    (["--quick", "--flash-seq", "100000000000"], "--flash-batch x --flash-seq x --flash-heads: the inputs need"),
    # Permission bits let root through: the whole benchmark ran, then a traceback at the write.
    (["--quick", "--out", "/proc/x.json"], "--out '/proc/x.json': cannot create the file"),
])
def test_bench_bad_flags_before_any_row(bench, argv, expected, monkeypatch, capsys):
    monkeypatch.setattr(bench, "run", lambda cfg: pytest.fail("a benchmark ran before the flags were checked"))
    rc = bench.cli(argv)
    cap = capsys.readouterr()
    err = cap.err.strip()
    assert rc == 2 and err.startswith("error: ") and "\n" not in err and expected in err, err


def test_bench_late_failures_are_one_line(bench, monkeypatch, capsys):
    """An error after the flags (a disk full at --out, Ctrl-C) ends as every experiment script's does."""
    for exc, code, line in ((OSError(28, "No space left on device"), 1, "error: [Errno 28] No space left on device"),
                            (KeyboardInterrupt(), 130, "interrupted")):
        def fail(cfg, exc=exc):
            raise exc

        monkeypatch.setattr(bench, "main", fail)
        assert bench.cli(["--quick"]) == code and capsys.readouterr().err.strip() == line


@pytest.mark.parametrize("argv, given", [
    (["--samples", "3", "--kv-heads", "4", "--q-heads", "8"], dict(samples=3, kv_heads=4, q_heads=8)),
    # Given explicitly at the full-size default: still kept under --quick.
    (["--context", "4096", "--head-dim", "128", "--q-heads", "32", "--kv-heads", "16"],
     dict(context=4096, head_dim=128, q_heads=32, kv_heads=16)),
])
def test_quick_keeps_explicit_flags(bench, monkeypatch, argv, given):
    seen = []
    monkeypatch.setattr(bench, "run", lambda cfg: seen.append(cfg) or [])
    assert bench.cli(["--quick", *argv]) == 0
    (cfg,) = seen
    assert {k: getattr(cfg, k) for k in given} == given  # as given
    assert {k: getattr(cfg, k) for k in bench.QUICK if k not in given} == {k: v for k, v in bench.QUICK.items() if k not in given}


def test_full_sizes_without_quick(bench, monkeypatch):
    seen = []
    monkeypatch.setattr(bench, "run", lambda cfg: seen.append(cfg) or [])
    assert bench.cli(["--batch", "2"]) == 0
    (cfg,) = seen
    assert cfg.batch == 2 and {k: getattr(cfg, k) for k in bench.FULL if k != "batch"} == {k: v for k, v in bench.FULL.items() if k != "batch"}
