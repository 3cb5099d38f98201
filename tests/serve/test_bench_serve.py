"""The serving benchmark runs end to end on the tiny model (slow: it runs every mode twice)."""

import re

import pytest

from tests.helpers import experiment


def _bench_serve():
    return experiment("bench_serve")


@pytest.mark.parametrize("change, message", [
    (dict(num_requests=0), "--num-requests=0; accepted: an integer >= 1"),
    (dict(block_size=0), "--block-size=0; accepted: an integer >= 1"),  # was a ZeroDivisionError
    (dict(max_num_seqs=0), "--max-num-seqs=0; accepted: an integer >= 1"),
    (dict(arrival="poisson", rate=1e-9), "--rate=1e-09; accepted: > 0 arrivals per second, with --num-requests / "
                                         "--rate at most 3600 s"),
    (dict(lora_adapters=2, max_loras=(4,)), "--max-loras 4; accepted: slot counts in 1..--lora-adapters"),
    (dict(lora_rank=8), "--lora-rank 8 needs --lora-adapters N"),
    (dict(num_speculative_tokens=-1), "--num-speculative-tokens=-1; accepted: >= 0"),
    (dict(speculative_layers=(0,)), "--num-speculative-tokens=0; accepted: >= 1 with a draft model"),
    (dict(num_speculative_tokens=2, speculative_layers=(0,), speculative_model="/models/my_draft"),
     "--speculative-model='/models/my_draft' and --speculative-layers=[0] both given; accepted: one of them"),
    (dict(arrival="uniform"), "--arrival='uniform'; accepted: burst, poisson"),
    (dict(arrival="poisson", rate=0.0), "--rate=0.0; accepted: > 0"),
    (dict(prompt_len=(10, 5)), "--prompt-len 10 5; accepted: LO HI with 1 <= LO <= HI"),
    (dict(output_len=(0, 4)), "--output-len 0 4"),
    (dict(hf_requests=65), "--hf-requests=65; accepted: 0..64"),
    (dict(num_blocks=0), "--num-blocks=0; accepted: an integer >= 1, or unset"),
    (dict(num_blocks=-1), "--num-blocks=-1; accepted: an integer >= 1, or unset"),
    (dict(lora_adapters=-1), "--lora-adapters=-1 --lora-rank=16; accepted: --lora-adapters >= 0 and --lora-rank >= 1"),
    (dict(lora_adapters=2, lora_rank=0), "--lora-adapters=2 --lora-rank=0; accepted"),
    (dict(max_loras=(2,)), "--max-loras 2; accepted: slot counts in 1..--lora-adapters, with --lora-adapters > 0"),
    (dict(lora_adapters=2, max_loras=(1, 0)), "--max-loras 1 0; accepted: slot counts in 1..--lora-adapters"),
    (dict(lora_adapters=2, max_loras=(2, 2)), "--max-loras 2 2 repeats a slot count; accepted: distinct"),
    (dict(rate=-3.0), "--rate=-3.0 needs --arrival poisson (--arrival burst sends every request at once)"),
    (dict(kv_cache_dtype="bogus"), "--kv-cache-dtype='bogus'; accepted: auto, bf16, fp8_e4m3, int8"),
    (dict(compute_dtype="foo"), "--compute-dtype='foo'; accepted: f32, bf16, f16"),  # after loading, unnamed
    (dict(random_weights=True, model="x.gguf"), "--random-weights builds a preset; --model 'x.gguf' is none"),
])
def test_bad_flags_are_refused_before_loading(change, message):
    mod = _bench_serve()
    with pytest.raises(ValueError, match=re.escape(message)):
        mod.check(mod.Config(**change))


@pytest.mark.parametrize("change, message", [
    (dict(prompt_len=(4, 500), output_len=(2, 20)), "--prompt-len 500 + --output-len 20 (the longest request) "
                                                    "exceeds the context of 'tiny' (512 tokens)"),
    (dict(model="tiny-moe", hf_requests=2), "--hf-requests 2 with the mixture-of-experts model 'tiny-moe': the HF "
                                            "run builds a dense Llama, other work; accepted: --hf-requests 0"),
])
def test_flags_that_do_not_fit_the_model_are_refused_by_flag_name(change, message):
    mod = _bench_serve()
    with pytest.raises(ValueError, match=re.escape(message)):
        mod.main(mod.Config(**{"model": "tiny", "num_requests": 4, "hf_requests": 0, **change}))


@pytest.mark.slow
def test_bench_serve_smoke(capsys):
    mod = _bench_serve()
    mod.main(mod.Config(model="tiny", num_requests=6, prompt_len=(4, 20), output_len=(2, 6), max_num_seqs=4,
                        hf_requests=0))
    out = capsys.readouterr().out
    assert "| (a) jmem continuous batching |" in out and "| (b) jmem static batching |" in out


@pytest.mark.slow
def test_bench_serve_with_more_lora_adapters_than_slots(capsys):
    """Three adapters in one slot take turns (slot writes counted), in three slots never move."""
    mod = _bench_serve()
    mod.main(mod.Config(model="tiny", num_requests=6, prompt_len=(4, 20), output_len=(2, 6), max_num_seqs=4,
                        hf_requests=0, lora_adapters=3, lora_rank=4))
    out = capsys.readouterr().out
    writes = {slots: re.search(rf"\| \(a\) \+ 3 LoRA adapters \(rank 4\) in {slots} \| \d+ / [\d.]+ \| "
                               rf"\d+ / [\d.]+ \| (\d+) / ", out) for slots in ("1 slot", "3 slots")}
    one, three = writes.values()
    assert one and three, out
    assert int(one.group(1)) >= 2 and int(three.group(1)) == 0


def test_step_split_counts_one_token_prompt_chunks_as_prefill_and_verified_proposals_as_decode():
    """With --max-num-batched-tokens 1 every prompt token went to the decode-only row, and a speculative
    decode (its proposals are several tokens) to the prefill row."""
    import types

    from jmem.serve.scheduler import ScheduledSeq, SchedulerOutput

    mod = _bench_serve()
    runner = types.SimpleNamespace(step=lambda out: None, load_adapters=lambda names: None,
                                   adapter_slots=types.SimpleNamespace(num_loads=0))
    split = mod.time_steps(types.SimpleNamespace(runner=runner))
    req = types.SimpleNamespace(num_tokens=10)
    for seqs in ([ScheduledSeq(req, 3, 1, [])], [ScheduledSeq(req, 4, 1, [])], [ScheduledSeq(req, 0, 8, [])],
                 [ScheduledSeq(req, 9, 1, [])], [ScheduledSeq(req, 9, 3, [], [5, 6])]):  # 3 prompt chunks, 2 decodes
        runner.step(SchedulerOutput(seqs=seqs))
    assert split["prefill"][0] == 3 and split["decode"][0] == 2
