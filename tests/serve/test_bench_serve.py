"""The serving benchmark runs end to end on the tiny model (slow: it runs every mode twice)."""

import re

import pytest

from tests.helpers import experiment


def _bench_serve():
    return experiment("bench_serve")


@pytest.mark.parametrize("change, message", [
    (dict(num_requests=0), "--num-requests=0; accepted: >= 1"),
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
])
def test_bad_flags_are_refused_before_loading(change, message):
    mod = _bench_serve()
    with pytest.raises(ValueError, match=re.escape(message)):
        mod.check(mod.Config(**change))


@pytest.mark.slow
def test_bench_serve_smoke(capsys):
    mod = _bench_serve()
    mod.main(mod.Config(model="tiny", num_requests=6, prompt_len=(4, 20), output_len=(2, 6), max_num_seqs=4,
                        hf_requests=0))
    out = capsys.readouterr().out
    assert "| (a) jmem continuous batching |" in out and "| (b) jmem static batching |" in out
