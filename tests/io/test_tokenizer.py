"""Tokenizers: the GGUF BPE round trip and specials, the byte tokenizer, chat templates."""

from jmem.io.tokenizer import ByteTokenizer
from tests.helpers import smollm2


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    text = "naïve café — 東京 🙂"
    ids = tok.encode(text)
    assert max(ids) < 256 and tok.decode(ids) == text
    assert tok.encode("a", add_bos=True) == [tok.bos_id, 97]
    assert "<|assistant|>" in tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_gguf_tokenizer_round_trip_and_specials():
    tok = smollm2().tokenizer
    for text in ["Hello world", "  two  spaces\n\nand 12345 digits", "naïve café 東京 🙂", "def f(x):\n\treturn x"]:
        assert tok.decode(tok.encode(text)) == text
    assert tok.encode("12") == [tok.encode("1")[0], tok.encode("2")[0]]  # digits split one by one
    ids = tok.encode("<|im_start|>user")
    assert ids[0] == 1 and tok.tokens[1] == "<|im_start|>"
    assert tok.decode(ids) == "user"  # specials are skipped when decoding
    assert tok.decode(ids, skip_special=False) == "<|im_start|>user"


def test_chat_template():
    tok = smollm2().tokenizer
    text = tok.apply_chat_template([{"role": "user", "content": "What is 2+2?"}])
    assert text.endswith("<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n")
    assert text.startswith("<|im_start|>system\n")
