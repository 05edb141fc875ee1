"""Tokenizers: exact round trips, BPE training, Hugging Face files with their own special tokens."""

import json
import random

import pytest
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, processors

from raylm.data.storage import StorageError
from raylm.data.tokenizer import (EOT_TOKEN, ByteTokenizer, HFTokenizer, byte_tokenizer_json, load_tokenizer,
                                  tokenizer_from_json, train_bpe)

# Code points from ASCII, Latin, Greek, Cyrillic, Arabic, CJK, Hangul and emoji (no surrogates).
_RANGES = [(0x20, 0x7E), (0x0A, 0x0A), (0x00, 0x1F), (0xC0, 0x24F), (0x370, 0x3FF), (0x400, 0x4FF),
           (0x600, 0x6FF), (0x4E00, 0x9FFF), (0xAC00, 0xD7A3), (0x1F300, 0x1FAFF), (0x300, 0x36F)]


def random_texts(count: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return ["".join(chr(rng.randint(*rng.choice(_RANGES))) for _ in range(rng.randint(0, 60)))
            for _ in range(count)]


def llama_like_tokenizer_json() -> str:
    """A byte-level tokenizer with <s> and </s> (no <|endoftext|>) whose post-processor wraps every
    encoding as "<s> ... </s>", as Llama 2 and Mistral tokenizers do."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = tokenizers.Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    tok.add_special_tokens(["<s>", "</s>"])
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", special_tokens=[("<s>", tok.token_to_id("<s>")), ("</s>", tok.token_to_id("</s>"))])
    assert tok.encode("hi").ids[-1] == tok.token_to_id("</s>")  # the file itself does add EOS
    return tok.to_str()


def test_byte_round_trip_of_any_text():
    tok = ByteTokenizer()
    texts = random_texts(200) + ["", "naïve café 東京 🤖🚀 \x00 \r\n", "<|endoftext|> is just text here"]
    for text in texts:
        ids = tok.encode(text)
        assert ids == list(text.encode("utf-8")) and all(0 <= i < 256 for i in ids)
        assert tok.decode(ids) == text
    assert tok.encode_batch(texts) == [tok.encode(t) for t in texts]
    assert (tok.vocab_size, tok.eot_id) == (257, 256)


def test_byte_decode_of_special_invalid_and_out_of_range_ids():
    tok = ByteTokenizer()
    assert tok.decode(tok.encode("a") + [tok.eot_id] + tok.encode("b")) == "a<|endoftext|>b"
    assert tok.decode([0xE6, 0x9D]) == "\ufffd"  # a cut multi-byte character, as sampling can produce
    with pytest.raises(ValueError, match="token id 300 .* 0..256"):
        tok.decode([300])


def test_byte_tokenizer_travels_as_json(tmp_path):
    tok = ByteTokenizer()
    path = str(tmp_path / "tokenizer.json")
    tok.save(path)
    loaded = load_tokenizer(path)
    assert isinstance(loaded, ByteTokenizer)
    assert loaded.sha256 == tok.sha256 == ByteTokenizer().sha256
    assert load_tokenizer(str(tmp_path)).sha256 == tok.sha256  # a directory holding tokenizer.json


def test_a_named_hugging_face_equivalent_of_the_byte_tokenizer_is_the_byte_tokenizer(tmp_path):
    """`raylm export` writes a byte model's tokenizer as its Hugging Face equivalent; preparing data
    with that file must fingerprint it as the byte tokenizer the model was trained (and imported)
    with, and encode every text to the same ids."""
    (tmp_path / "tokenizer.json").write_text(byte_tokenizer_json())
    named = load_tokenizer(str(tmp_path))
    assert isinstance(named, ByteTokenizer) and named.sha256 == ByteTokenizer().sha256
    as_written = tokenizer_from_json(byte_tokenizer_json())  # a dataset's own file: read as recorded
    assert isinstance(as_written, HFTokenizer) and as_written.sha256 != named.sha256
    texts = random_texts(50, seed=3) + ["<|endoftext|> inside a document"]
    assert as_written.encode_batch(texts) == named.encode_batch(texts)
    one_merge = json.loads(byte_tokenizer_json())
    one_merge["model"]["merges"] = [["a", "b"]]
    one_merge["model"]["vocab"]["ab"] = 257
    (tmp_path / "tokenizer.json").write_text(json.dumps(one_merge))
    assert isinstance(load_tokenizer(str(tmp_path)), HFTokenizer)  # a real BPE stays one


def test_train_bpe_round_trips_and_compresses(tmp_path):
    rng = random.Random(1)
    words = "river stone castle winter bread horse crown silver morning ship".split()
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    texts = [" ".join(rng.choice(words) for _ in range(80)) for _ in range(40)]
    (corpus / "a.txt").write_text("\n".join(texts[:20]))
    (corpus / "b.jsonl").write_text("\n".join(json.dumps({"text": t}) for t in texts[20:]))
    out = str(tmp_path / "bpe" / "tokenizer.json")

    tok = train_bpe([str(corpus)], vocab_size=320, output_uri=out, lines_as_documents=True)
    assert tok.kind == "hf" and tok.vocab_size <= 320
    assert tok.eot_token == EOT_TOKEN
    sample = texts[0]
    assert len(tok.encode(sample)) < len(sample.encode("utf-8")) / 2  # merges were learned
    for text in random_texts(50, seed=2) + texts[:3]:  # byte-level: unseen scripts round-trip too
        assert tok.decode(tok.encode(text)) == text
    assert tok.eot_id not in tok.encode(f"a {EOT_TOKEN} b")  # the string in a document is text
    assert tok.decode([tok.eot_id]) == EOT_TOKEN

    loaded = load_tokenizer(out)
    assert loaded.sha256 == tok.sha256
    assert loaded.encode_batch(texts[:5]) == tok.encode_batch(texts[:5])


def test_tokenizer_train_without_input_trains_on_the_built_in_corpus(tmp_path):
    """As `make demo` runs it: no --input is the built-in corpus, as for `raylm prepare`."""
    from tests.support.checkpoints import run_cli

    out = tmp_path / "bpe.json"
    done = run_cli("tokenizer", "train", "--vocab-size", "300", "--output", str(out))
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == f"wrote {out}: BPE with 300 tokens"
    assert "print(" in load_tokenizer(str(out)).decode(load_tokenizer(str(out)).encode("print(x)"))


def test_train_bpe_rejects_a_byte_sized_vocabulary(tmp_path):
    with pytest.raises(ValueError, match="vocab_size must exceed 257"):
        train_bpe([], vocab_size=257, output_uri=str(tmp_path / "t.json"))


def test_hf_tokenizer_does_not_add_its_own_special_tokens(tmp_path):
    path = tmp_path / "tokenizer.json"
    path.write_text(llama_like_tokenizer_json())
    tok = load_tokenizer(str(path))
    assert tok.eot_token == "</s>"
    bos = tok.vocab_size - 2
    for text in random_texts(30, seed=3) + ["x </s> <s> y"]:
        ids = tok.encode(text)
        assert tok.eot_id not in ids and bos not in ids
        assert tok.decode(ids) == text
    assert tokenizer_from_json(tok.to_json()).sha256 == tok.sha256


def test_hf_tokenizer_without_end_of_text_fails_clearly():
    tok = tokenizers.Tokenizer(models.WordLevel(vocab={"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    with pytest.raises(ValueError, match=r"no end-of-text token: none of <\|endoftext\|>.*</s>"):
        HFTokenizer(tok.to_str(), name="wordlevel.json")


def test_load_tokenizer_errors_name_the_location(tmp_path):
    with pytest.raises(StorageError, match="nowhere.json not found"):
        load_tokenizer(str(tmp_path / "nowhere.json"))
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="bad.json: not valid JSON"):
        load_tokenizer(str(bad))
