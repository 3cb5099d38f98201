"""The `jmem` command, run as a user would."""

import subprocess
import sys

import pytest

from jmem.lm import packaged_model_path
from tests.helpers import refuse_load


def _jmem(*args):
    return subprocess.run([sys.executable, "-m", "jmem", *args], capture_output=True, text=True, timeout=600)


def test_generate_tiny():
    r = _jmem("generate", "--model", "tiny", "--prompt", "hi", "--max-new-tokens", "4")
    assert r.returncode == 0, r.stderr


@pytest.mark.slow
def test_generate_with_a_draft_model_matches_plain_greedy(tmp_path):
    """`--draft`: speculative decoding gives the target's own greedy text."""
    target = _tiny_gguf(tmp_path / "t.gguf")
    draft = _tiny_gguf(tmp_path / "d.gguf", dim=32, head_dim=8, ffn_dim=64)
    plain = _jmem("generate", "--model", target, "--prompt", "hello", "--max-new-tokens", "12")
    spec = _jmem("generate", "--model", target, "--draft", draft, "--draft-k", "3", "--prompt", "hello",
                 "--max-new-tokens", "12")
    assert plain.returncode == 0 and spec.returncode == 0, spec.stderr
    assert spec.stdout == plain.stdout and "proposals accepted" in spec.stderr
    bad = _jmem("generate", "--model", target, "--draft", draft, "--top-k", "5")
    assert bad.returncode == 2 and "no --top-k / --top-p with --draft" in bad.stderr


def test_help_names_every_subcommand():
    r = _jmem("--help")
    assert r.returncode == 0, r.stderr
    assert "{generate,info,serve,quantize}" in r.stdout, r.stdout
    for command, summary in (("serve", "Serve a model over HTTP with the OpenAI API."),
                             ("quantize", "Quantize a model and write it as a GGUF file")):
        assert summary in r.stdout
        sub = _jmem(command, "--help")
        assert sub.returncode == 0 and f"usage: jmem {command} [-h]" in sub.stdout and "--model" in sub.stdout, \
            sub.stdout


def test_serve_help_names_every_model_source():
    """--model takes what jmem.load takes: the packaged model, a preset, a .gguf file or a `jmem quantize
    --out DIR` directory."""
    r = _jmem("serve", "--help")
    text = " ".join(r.stdout.replace("│", " ").split())  # the help as one line, whatever the terminal's width
    assert "The packaged smollm2-135m, a random-init preset (tiny, ...), a .gguf path or a model directory written " \
        "by `jmem quantize --out DIR` or `experiments/train.py --save DIR`" in text, text


def test_serve_subcommand_runs_the_server_checks():
    r = _jmem("serve", "--model", "tiny", "--kv-cache-dtype", "fp4")
    assert r.returncode == 2 and r.stderr == ("jmem serve: error: --kv-cache-dtype='fp4'; accepted: auto, bf16, "
                                              "fp8_e4m3, int8\n"), r.stderr
    r = _jmem("serve", "--model", "tiny", "--compute-dtype", "f8")  # named the dtype, not the flag
    assert r.returncode == 2 and r.stderr.startswith("jmem serve: error: --compute-dtype='f8': dtype 'f8' is not "
                                                     "supported; accepted: f32"), r.stderr


def test_info_smollm2():
    try:
        path = packaged_model_path("smollm2-135m")
    except FileNotFoundError as e:
        pytest.skip(str(e))
    r = _jmem("info", path)
    assert r.returncode == 0, r.stderr
    assert "architecture:  llama" in r.stdout and "Q4_1 x210" in r.stdout and "134.5M" in r.stdout


def test_info_by_packaged_name_reads_the_packaged_gguf(capsys):
    """`jmem info smollm2-135m` describes the file `jmem generate --model smollm2-135m` loads."""
    from jmem.cli import main

    try:
        path = packaged_model_path("smollm2-135m")
    except FileNotFoundError as e:
        pytest.skip(str(e))
    code, out, err = _in_process(main, ["info", "smollm2-135m"], capsys)
    assert code == 0, err
    assert f"file:          {path}" in out and "Q4_1 x210" in out


@pytest.mark.parametrize("arg, expected", [
    ("nosuch", "jmem: error: 'nosuch': no such file or directory; accepted: a .gguf file, a directory written by "
               "`jmem quantize --out DIR`, or a packaged model name (smollm2-135m)"),
    ("tiny", "jmem: error: 'tiny' is a random-init preset, with no file to describe; accepted: a .gguf file"),
    ("DIR", "jmem: error: 'DIR' is a directory without jmem_model.json; accepted: a .gguf file"),
])
def test_info_bad_path_says_what_is_accepted(arg, expected, tmp_path, monkeypatch, capsys):
    from jmem.cli import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "DIR").mkdir()
    code, _, err = _in_process(main, ["info", arg], capsys)
    assert code == 2 and err.count("\n") == 1 and err.startswith(expected), err


@pytest.mark.parametrize("args, expected", [
    (["--temperature", "inf"], "--temperature=inf; accepted: a finite number >= 0 (0 is greedy)"),
    (["--temperature", "nan"], "--temperature=nan; accepted: a finite number >= 0"),
    (["--temperature", "-1"], "--temperature=-1.0; accepted: a finite number >= 0"),
    (["--top-p", "inf"], "--top-p=inf; accepted: a number in (0, 1], or unset (off)"),
    (["--top-p", "nan"], "--top-p=nan; accepted: a number in (0, 1]"),
    (["--top-p", "0"], "--top-p=0.0; accepted: a number in (0, 1]"),
    (["--top-k", "-2"], "--top-k=-2; accepted: an integer in 1..2**31-1, or unset, 0 or -1 (off)"),
    (["--top-k", "2147483648"], "--top-k=2147483648; accepted: an integer in 1..2**31-1, or unset, 0 or -1 (off)"),
    (["--max-new-tokens", "-1"], "--max-new-tokens=-1; accepted: an integer >= 0"),
    (["--draft", "tiny", "--draft-k", "0"], "--draft-k=0; accepted: an integer >= 1"),
    (["--draft-k", "3"], "--draft-k=3 without --draft; accepted: --draft-k with a --draft model"),  # was ignored
    (["--draft", "/missing/draft.gguf"], "--draft '/missing/draft.gguf' is neither a file nor a directory nor a "
                                         "known name; accepted: a .gguf path"),
    (["--draft", "tinyy"], "--draft 'tinyy' is neither"),
    # Refused after both models loaded, by the decoder, without naming --draft.
    (["--draft", "bench-8l"], "--draft 'bench-8l' has a vocabulary of 8192 tokens, --model 'tiny' one of 259; "
                              "accepted: a draft with the model's tokenizer"),
])
def test_generate_refuses_bad_sampling_flags_before_loading(args, expected, monkeypatch, capsys):
    import jmem
    from jmem.cli import main

    monkeypatch.setattr(jmem, "load", refuse_load)
    code, _, err = _in_process(main, ["generate", "--model", "tiny", *args], capsys)
    assert code == 2 and err.count("\n") == 1 and err.startswith(f"jmem: error: {expected}"), err


def test_bad_input_is_one_line(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"nope")
    for args in (["info", str(bad)], ["generate", "--model", "nope"]):
        r = _jmem(*args)
        assert r.returncode == 2
        assert r.stderr.strip().count("\n") == 0 and "Traceback" not in r.stderr, r.stderr


def _in_process(main, argv, capsys):
    """(exit status, stdout, stderr) of a CLI entry point run in this process."""
    try:
        main(argv)
        code = 0
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err


def _tiny_gguf(path, **fields):
    from jmem.io.gguf_writer import byte_tokenizer_metadata, write_gguf
    from jmem.models.config import LlamaConfig
    from tests.helpers import random_model

    cfg = LlamaConfig.tiny(n_layers=1, **fields)
    write_gguf(path, cfg, random_model(cfg, 0), tokenizer_metadata=byte_tokenizer_metadata())
    return str(path)


def test_info_missing_key_is_one_line(tmp_path, capsys):
    import gguf
    import numpy as np

    from jmem.cli import main

    path = tmp_path / "no_vocab.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_embedding_length(8)
    w.add_feed_forward_length(16)
    w.add_head_count(2)
    w.add_tensor("token_embd.weight", np.ones((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    code, _, err = _in_process(main, ["info", str(path)], capsys)
    assert code == 2 and err == f"jmem: error: {path}: required key tokenizer.ggml.tokens is missing\n", err
    code, out, _ = _in_process(main, ["info", _tiny_gguf(tmp_path / "s.gguf", rope_scaling="linear",
                                                         rope_factor=8.0)], capsys)
    assert code == 0 and "scaling: linear x8" in out


def test_quantize_refuses_to_overwrite(tmp_path, capsys):
    from jmem.cli import main

    src = _tiny_gguf(tmp_path / "src.gguf")
    before = open(src, "rb").read()
    code, _, err = _in_process(main, ["quantize", "--model", src, "--method", "q8_0", "--out", src, "--force"], capsys)
    assert code == 2 and "is the --model file itself" in err and open(src, "rb").read() == before
    other = tmp_path / "out.gguf"
    other.write_bytes(b"keep me")
    code, _, err = _in_process(main, ["quantize", "--model", src, "--method", "q8_0", "--out", str(other)], capsys)
    assert code == 2 and "already exists; pass --force" in err and other.read_bytes() == b"keep me"
    code, out, err = _in_process(main, ["quantize", "--model", src, "--method", "q8_0", "--out", str(other), "--force"],
                                 capsys)
    assert code == 0, err
    assert "Q8_0" in out and other.read_bytes()[:4] == b"GGUF"


def test_generate_refuses_a_draft_with_other_tokens(tmp_path, capsys):
    from jmem.cli import main
    from jmem.io.gguf_writer import byte_tokenizer_metadata, write_gguf
    from jmem.models.config import LlamaConfig
    from tests.helpers import random_model

    target = _tiny_gguf(tmp_path / "t.gguf")
    meta = byte_tokenizer_metadata()
    tokens = list(meta["tokenizer.ggml.tokens"])
    tokens[97], tokens[98] = tokens[98], tokens[97]
    cfg = LlamaConfig.tiny(n_layers=1)
    draft = str(tmp_path / "d.gguf")
    write_gguf(draft, cfg, random_model(cfg, 0), tokenizer_metadata={**meta, "tokenizer.ggml.tokens": tokens})
    code, _, err = _in_process(main, ["generate", "--model", target, "--draft", draft, "--prompt", "hi"], capsys)
    assert code == 2 and err == (f"jmem: error: --draft {draft!r}'s token 97 is 'b', the model's 'a'; accepted: "
                                 "a draft with the model's tokenizer\n"), err


def _with_closed_stdout(*args, **env):
    """A `jmem` command whose stdout reader has gone (as `| head` does once it has its lines)."""
    import os

    read, write = os.pipe()
    os.close(read)
    try:
        return subprocess.run([sys.executable, "-m", "jmem", *args], stdout=write, stderr=subprocess.PIPE,
                              text=True, timeout=600, env={**os.environ, **env})
    finally:
        os.close(write)


def test_a_closed_stdout_ends_quietly_and_keeps_what_was_written(tmp_path):
    """It was "error: [Errno 32] Broken pipe" with status 2, and `quantize` deleted the file it had written."""
    import jmem

    out = tmp_path / "q.gguf"
    r = _with_closed_stdout("quantize", "--model", "tiny", "--method", "q8_0", "--out", str(out),
                            PYTHONUNBUFFERED="1")
    assert r.returncode == 141 and r.stderr == "", r.stderr
    assert jmem.load(str(out)).config.n_layers == 2
    r = _with_closed_stdout("info", str(out))
    assert r.returncode == 141 and r.stderr == "", r.stderr


def test_quantize_force_never_overwrites_a_packaged_model_file(tmp_path, capsys, monkeypatch):
    """`--model smollm2-135m --out <its file> --force` replaced the installed model: the name was compared,
    not the file it names."""
    import jmem.lm
    from jmem.cli import main

    packaged = _tiny_gguf(tmp_path / "packaged.gguf")
    before = open(packaged, "rb").read()
    monkeypatch.setattr(jmem.lm, "packaged_model_path", lambda name: packaged)
    code, _, err = _in_process(main, ["quantize", "--model", "smollm2-135m", "--method", "q8_0", "--out", packaged,
                                      "--force"], capsys)
    assert code == 2 and "is the --model file itself" in err, err
    assert open(packaged, "rb").read() == before


def test_prompt_info_path_and_interrupt_errors(tmp_path, capsys, monkeypatch):
    import numpy as np

    import jmem.cli
    from jmem.cli import main

    code, _, err = _in_process(main, ["generate", "--model", "tiny", "--prompt", "\udcff abc"], capsys)
    assert code == 2 and err == ("jmem: error: --prompt holds bytes that are not UTF-8 text (at character 0); "
                                 "accepted: UTF-8 text\n")
    monkeypatch.setenv("HOME", str(tmp_path))
    _tiny_gguf(tmp_path / "t.gguf")
    code, out, err = _in_process(main, ["info", "~/t.gguf"], capsys)  # as `generate --model ~/t.gguf` reads it
    assert code == 0 and f"file:          {tmp_path / 't.gguf'}" in out, err
    np.savez(tmp_path / "ad.npz", x=np.zeros(2))
    code, _, err = _in_process(main, ["info", str(tmp_path / "ad.npz")], capsys)
    assert code == 2 and "is not a GGUF file (magic b'PK\\x03\\x04', expected b'GGUF') (a .npz of LoRA adapters " \
        "is served with `jmem serve --lora-modules NAME=PATH`); accepted: a GGUF model file" in err, err

    def interrupted(path: jmem.cli.tyro.conf.Positional[str]) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(jmem.cli, "info", interrupted)
    code, _, err = _in_process(main, ["info", "x"], capsys)
    assert code == 130 and err == "jmem: interrupted\n"


def test_generate_reads_the_prompt_from_stdin_and_ends_at_stop_strings(capsys, monkeypatch):
    import io

    from jmem.cli import main

    argv = ["generate", "--model", "tiny", "--max-new-tokens", "12"]
    code, plain, err = _in_process(main, [*argv, "--prompt", "hi"], capsys)
    assert code == 0, err
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO("hi".encode())))
    assert _in_process(main, [*argv, "--prompt", "-"], capsys)[1] == plain
    text = plain[:-1]
    stop = text[4:6]
    code, out, err = _in_process(main, [*argv, "--prompt", "hi", "--stop", "never there", stop], capsys)
    assert code == 0 and out == text[: text.find(stop)] + "\n", (out, text, stop)
    code, _, err = _in_process(main, [*argv, "--stop", ""], capsys)
    assert code == 2 and err == "jmem: error: --stop ['']; accepted: non-empty strings\n"
    sampled = [*argv, "--prompt", "hi", "--temperature", "1", "--seed", "3"]
    off = _in_process(main, sampled, capsys)[1]
    for k in ("0", "-1"):  # off, as the server and vLLM read them (refused before)
        assert _in_process(main, [*sampled, "--top-k", k], capsys)[1] == off
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(b"ok \xff")))
    code, _, err = _in_process(main, [*argv, "--prompt", "-"], capsys)
    assert code == 2 and err == ("jmem: error: standard input (--prompt -) holds bytes that are not UTF-8 text "
                                 "(at byte 3); accepted: UTF-8 text\n")


def test_generate_with_a_lora_adapter_matches_the_merged_model(tmp_path, capsys):
    """`--lora FILE`: the completion of the base model with that adapter (as its merged weights give);
    an adapter of another base, or a file that is none, is one line."""
    from flax import nnx

    import jmem
    from jmem.cli import main
    from jmem.lora import load_adapters, merge
    from jmem.models import Llama, LlamaConfig
    from tests.helpers import random_adapter

    lm = jmem.load("tiny")
    path = random_adapter(lm.model, tmp_path / "a.npz", 1, 4, ("wq", "wv", "w_down"), alpha=64.0)
    argv = ["generate", "--model", "tiny", "--prompt", "hello", "--max-new-tokens", "10"]
    code, plain, err = _in_process(main, argv, capsys)
    assert code == 0, err
    code, adapted, err = _in_process(main, [*argv, "--lora", str(path)], capsys)
    assert code == 0, err
    merged = jmem.LM(merge(load_adapters(lm.model, path)), lm.tokenizer)
    assert adapted == merged.generate(["hello"], max_new_tokens=10)[0] + "\n" and adapted != plain
    other_base = Llama(LlamaConfig.tiny(), rngs=nnx.Rngs(9))
    other = random_adapter(other_base, tmp_path / "o.npz", 1, 4, ("wq",))
    code, _, err = _in_process(main, [*argv, "--lora", str(other)], capsys)
    assert code == 2 and "o.npz' was trained on another base model: its wq weights do not match" in err, err
    code, adapted, err = _in_process(main, [*argv, "--lora", str(other), "--init-seed", "9"], capsys)  # its base
    assert code == 0, err
    assert adapted == jmem.LM(merge(load_adapters(other_base, other)), lm.tokenizer).generate(
        ["hello"], max_new_tokens=10)[0] + "\n"
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    code, _, err = _in_process(main, ["generate", "--model", str(tmp_path / "m.gguf"), "--init-seed", "9"], capsys)
    assert code == 2 and "--init-seed=9 draws a random-init preset's weights; model" in err, err
    (tmp_path / "junk.npz").write_bytes(b"no")
    code, _, err = _in_process(main, [*argv, "--lora", str(tmp_path / "junk.npz")], capsys)
    assert code == 2 and "junk.npz' is not a LoRA adapter file written by jmem.lora.save_adapters" in err, err
    assert "(not an .npz archive)" in err and "pickle" not in err, err  # numpy's text invited an unsafe load
