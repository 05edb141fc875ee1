"""prepare's opt-in quality filter (`raylm.data.quality`) on real files with real Ray: datatrove's
Gopher filters drop exactly the documents they must, the manifest counts them by filter, reason
and file, a prepare without the filter writes the bytes it wrote before the filter existed, and a
prepare the filter empties leaves the dataset it was to replace whole."""

from __future__ import annotations

import hashlib
import json
import random
import string
import subprocess
import sys

import pytest

from raylm.config import ConfigError
from raylm.data.corpus import InputError
from raylm.data.inspect import verify_dataset
from raylm.data.manifest import DatasetError, load_manifest
from raylm.data.prepare import prepare_dataset
from raylm.data.tokenizer import ByteTokenizer
from tests.data.test_prepare import SEQ_LEN, check_split, expected_stream, is_val
from tests.support.cli import assert_clean_refusal, run_main

pytestmark = pytest.mark.usefixtures("ray_session")

CLEAN = [
    "The river that runs through the old town has shaped its history for more than a thousand years. "
    "Merchants came down the valley with wool and salt, and the market square grew up beside the bridge "
    "where they paid their tolls. Most of the houses that line the water today were built after the great "
    "fire, when the council decided that every new building had to be made of stone and covered with slate.",
    "Bread is one of the oldest prepared foods, and its basic recipe has changed very little. Flour, water "
    "and salt are mixed into a dough, which is left to rise with yeast or a sourdough starter before it is "
    "shaped and baked. The long, slow rise gives the crumb its open texture and the crust its deep colour, "
    "while a short one makes a denser loaf that keeps well and travels with ease.",
    "Early sailors found their way across open water by reading the stars, the swell of the sea and the "
    "flight of birds. A navigator who knew the height of a particular star at his home port could sail north "
    "or south until it stood at the same angle, and then turn east or west to follow that line of latitude "
    "to the harbour. The method was slow but it worked well enough to settle distant islands.",
    "A small garden can feed a family for much of the summer if it is planned with care. Beans and peas climb "
    "to save space, lettuce grows quickly in the shade of taller plants, and tomatoes need a warm wall and "
    "steady water. Turning the soil with compost each autumn keeps it rich, and rotating the crops from one "
    "bed to the next helps to keep pests and disease away from the young plants in spring.",
]
SHORT = "Click here to subscribe to our newsletter."
REPEATED = "The price of the watch is low and the quality is high, with free delivery to your door.\n" * 10
SYMBOLS = "\n".join(f"| 0x{i * 37 % 256:02x} | {i * 13 % 97:>3} | {'#' * (i % 5 + 1)} | --- | {i * i % 1000} |"
                    for i in range(40))
# The poisoned window: random printable characters.
NOISE = "".join(random.Random(60).choices(string.ascii_letters + string.digits + string.punctuation + "  ", k=1500))

DROPPED_BY_FILE = {  # what Gopher's rules say of each bad document, by file
    "b-mixed.jsonl": {"gopher_quality": {"gopher_short_doc": 1}, "gopher_repetition": {"dup_line_frac": 1}},
    "c-noise.jsonl": {"gopher_quality": {"gopher_below_avg_threshold": 1, "gopher_above_avg_threshold": 1}},
}

# What prepare wrote for this corpus (seq_len 32, val_fraction 0.2, shard_rows 20) at fc189bf, before
# the quality filter existed; the manifest's one absolute path (its source) replaced by "corpus".
PLAIN_SHA256 = {
    "manifest.json": "e84f4c8766635a0a85e9e99f331be78c92a0875f9d36d75abb2bcfadf1e8f22f",
    "tokenizer.json": "0d739a2f80aab6ea690d6490abcd7653bcc0f7324b2561c4af800c134679643a",
    "train-00000.parquet": "a3d57453340508061c19f8bf0c92ea399714bb138e764c1fd1f86f130a51036a",
    "train-00001.parquet": "f15d991f50740ce54760f0b9b18f401189a2ab9acc7c1a046bf13c98d5d3282b",
    "train-00002.parquet": "b81c11742c988c2597e80c8489c56638f163888d86c349efaddac43bcb33f550",
    "train-00003.parquet": "397fb96ef63c14c8e860ce519b8d0b6e22215beb0f5dd444f5e7f604f83171b4",
    "train-00004.parquet": "c717808e2ee0dd0e3b9b84f5d429187c84ecd1e2b33ab9ef72fa10af9b78c728",
    "train-00005.parquet": "e469041d7da91f2595b8a160a9444307a9a066f0653c963f34c2d4eccbb552d4",
    "train-00006.parquet": "788a44537cf1eb6f037c3f406aa767ed04fdbe092dd64875a3bd4743edd04d23",
    "train-00007.parquet": "65de8ca106898bd47c0b054e8b05d738b881244a37c52f5e18400edf0fbf066a",
    "val-00000.parquet": "1eed9fe2b09d7588ecbe59efc9384117776a4cc62125ddd8297db4e896c3cb61",
}


def write_corpus(root) -> str:
    """Three files: a clean .txt, and two .jsonl files of clean documents among bad ones."""
    root.mkdir()
    (root / "a-clean.txt").write_text(CLEAN[0])
    for name, docs in (("b-mixed.jsonl", [CLEAN[1], SHORT, CLEAN[2], REPEATED]),
                       ("c-noise.jsonl", [SYMBOLS, NOISE, CLEAN[3]])):
        (root / name).write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return str(root)


def file_sha256(dataset, corpus: str) -> dict[str, str]:
    hashes = {}
    for path in sorted(dataset.iterdir()):
        data = path.read_bytes()
        if path.name == "manifest.json":
            data = data.replace(json.dumps(corpus).encode(), b'"corpus"')
        hashes[path.name] = hashlib.sha256(data).hexdigest()
    return hashes


@pytest.fixture(scope="module")
def filtered(tmp_path_factory):
    """The corpus prepared through the CLI with --quality-filter gopher: (root, outcome)."""
    root = tmp_path_factory.mktemp("filtered")
    corpus = write_corpus(root / "corpus")
    outcome = run_main("prepare", "--input", corpus, "--output", str(root / "out"), "--seq-len", str(SEQ_LEN),
                       "--val-fraction", "0.2", "--quality-filter", "gopher")
    assert outcome.status == 0, outcome.stderr[-3000:]
    return root, outcome


def test_gopher_drops_exactly_the_bad_documents_and_the_manifest_counts_them_by_reason_and_file(filtered):
    root, outcome = filtered
    out = str(root / "out")
    manifest = load_manifest(out)
    # Every clean document, and nothing else, in its split in corpus order (the rows are exactly
    # those of the clean documents' streams).
    for split in ("train", "val"):
        docs = [d for d in CLEAN if is_val(d, 0.2) == (split == "val")]
        assert docs
        check_split(out, manifest, split, expected_stream(ByteTokenizer(), docs))

    info = manifest.quality_filter
    assert info.name == "gopher" and info.library.startswith("datatrove ")
    assert info.files == {str(root / "corpus" / name): counts for name, counts in DROPPED_BY_FILE.items()}
    assert info.dropped == {"gopher_quality": {"gopher_above_avg_threshold": 1, "gopher_below_avg_threshold": 1,
                                               "gopher_short_doc": 1},
                            "gopher_repetition": {"dup_line_frac": 1}}
    assert info.documents == 4
    assert ("raylm: prepare: the gopher quality filter dropped 4 of 8 documents (gopher_quality/"
            "gopher_above_avg_threshold 1, gopher_quality/gopher_below_avg_threshold 1, gopher_quality/"
            "gopher_short_doc 1, gopher_repetition/dup_line_frac 1), from 2 file(s)") in outcome.stdout
    assert verify_dataset(out) == []
    shown = run_main("data", "inspect", out)
    assert shown.status == 0, shown.stderr[-3000:]
    assert (f"quality      the gopher filter ({info.library}) dropped 4 documents (gopher_quality/"
            "gopher_above_avg_threshold 1, gopher_quality/gopher_below_avg_threshold 1, gopher_quality/"
            "gopher_short_doc 1, gopher_repetition/dup_line_frac 1) from 2 file(s)") in shown.stdout, shown.stdout


def test_a_manifest_whose_drop_counts_do_not_add_up_is_refused(filtered, tmp_path):
    root, _ = filtered
    written = json.loads((root / "out" / "manifest.json").read_text())
    written["quality_filter"]["dropped"]["gopher_quality"]["gopher_short_doc"] = 2
    (tmp_path / "manifest.json").write_text(json.dumps(written))
    with pytest.raises(DatasetError, match="quality_filter.dropped differs from the sums over quality_filter.files"):
        load_manifest(str(tmp_path))
    written["quality_filter"]["dropped"]["gopher_quality"]["gopher_short_doc"] = -1
    (tmp_path / "manifest.json").write_text(json.dumps(written))
    with pytest.raises(DatasetError, match=r"quality_filter.dropped.gopher_quality.gopher_short_doc is -1"):
        load_manifest(str(tmp_path))


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """The same corpus prepared without a filter (the default): (corpus, output directory)."""
    root = tmp_path_factory.mktemp("plain")
    corpus = write_corpus(root / "corpus")
    prepare_dataset([corpus], str(root / "out"), seq_len=SEQ_LEN, val_fraction=0.2, shard_rows=20)
    return corpus, root / "out"


def test_without_the_filter_prepare_writes_the_bytes_it_wrote_before_the_filter(plain):
    corpus, out = plain
    assert file_sha256(out, corpus) == PLAIN_SHA256
    assert "quality_filter" not in json.loads((out / "manifest.json").read_text())


def test_a_prepare_the_filter_empties_fails_and_leaves_the_earlier_dataset_whole(plain, tmp_path):
    corpus, out = plain
    bad = tmp_path / "bad.jsonl"
    bad.write_text("".join(json.dumps({"text": d}) + "\n" for d in (SHORT, REPEATED, NOISE)))
    with pytest.raises(InputError, match=r"the gopher quality filter dropped 3 of 3 documents .*: no document is "
                                         r"left to prepare"):
        prepare_dataset([str(bad)], str(out), seq_len=SEQ_LEN, overwrite=True, quality_filter="gopher")
    assert file_sha256(out, corpus) == PLAIN_SHA256
    assert [p.name for p in out.parent.iterdir() if ".staging-" in p.name] == []


def test_max_documents_counts_the_documents_read_the_dropped_among_them(tmp_path):
    corpus = write_corpus(tmp_path / "corpus")
    manifest = prepare_dataset([corpus], str(tmp_path / "out"), seq_len=SEQ_LEN, val_fraction=0.0, max_documents=3,
                               quality_filter="gopher")
    check_split(str(tmp_path / "out"), manifest, "train", expected_stream(ByteTokenizer(), CLEAN[:2]))
    assert manifest.quality_filter.files == {str(tmp_path / "corpus" / "b-mixed.jsonl"):
                                             {"gopher_quality": {"gopher_short_doc": 1}}}


def test_an_unknown_filter_is_refused_naming_the_field(tmp_path):
    corpus = write_corpus(tmp_path / "corpus")
    with pytest.raises(ConfigError, match=r"quality_filter is 'fineweb'; valid: gopher"):
        prepare_dataset([corpus], str(tmp_path / "out"), quality_filter="fineweb")
    assert_clean_refusal(run_main("prepare", "--input", corpus, "--output", str(tmp_path / "out"),
                                  "--quality-filter", "fineweb"), "--quality-filter")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("missing", ["datatrove", "spacy"])
def test_without_the_extra_the_filter_is_refused_naming_it(tmp_path, missing):
    """A Python where `import datatrove` (or spacy) fails, as where the extra is not installed."""
    corpus = write_corpus(tmp_path / "corpus")
    argv = ["prepare", "--input", corpus, "--output", str(tmp_path / "out"), "--quality-filter", "gopher"]
    result = subprocess.run([sys.executable, "-c", f"import sys; sys.modules[{missing!r}] = None\n"
                             f"from raylm.cli import main; main({argv!r})"],
                            capture_output=True, text=True, timeout=120)
    assert_clean_refusal(result, "pip install 'raylm[quality]'")
    assert f"and {missing} is not installed" in result.stderr
    assert not (tmp_path / "out").exists()
