"""The data package: byte tokenizer, bundled stdlib corpus, packed windows over indexed datasets, mock tokens.

Everything runs on a CPU against megatron-core's real indexed-dataset classes, with caches under tmp_path.
"""

import multiprocessing
import os
import pickle
import sysconfig
from pathlib import Path

import numpy as np
import pytest

from recipes.config import ConfigError, DataConfig, DataKind, load_option
from recipes.data import corpus
from recipes.data.corpus import build_corpus
from recipes.data.dataset import make_dataset
from recipes.data.corpus import EXCLUDED_DIRS, stdlib_sources
from recipes.data.megatron_indexed import IndexedDataset, IndexedDatasetBuilder, get_bin_path, get_idx_path
from recipes.data.tokenizer import EOD, EOD_TEXT, VOCAB_SIZE, decode, encode


def bundled(tmp_path: Path) -> DataConfig:
    return DataConfig(name="stdlib", cache_dir=str(tmp_path))


def write_indexed(prefix: Path, documents: list[list[np.ndarray]], dtype=np.int32) -> None:
    """An indexed dataset whose documents are made of the given sequences (megatron-core allows several)."""
    builder = IndexedDatasetBuilder(get_bin_path(str(prefix)), dtype=dtype)
    for sequences in documents:
        builder.add_document(np.concatenate(sequences), lengths=[len(s) for s in sequences])
    builder.finalize(get_idx_path(str(prefix)))


@pytest.fixture
def handmade(tmp_path):
    """Random documents of awkward lengths (one of them split into sequences, one sequence empty) and their
    concatenated token stream, which the windows must follow exactly."""
    rng = np.random.default_rng(0)
    documents = [[rng.integers(0, 1000, rng.integers(1, 30))] for _ in range(40)]
    documents[3] = [rng.integers(0, 1000, 5), np.zeros(0, dtype=np.int64), rng.integers(0, 1000, 11)]
    prefix = tmp_path / "handmade"
    write_indexed(prefix, documents)
    stream = np.concatenate([s for sequences in documents for s in sequences])
    document_ends = np.cumsum([sum(len(s) for s in sequences) for sequences in documents])
    return DataConfig(name="handmade", path=str(prefix)), stream, document_ends


# ---- tokenizer ----


def test_tokenizer_round_trips_utf8_bytes():
    text = "héllo, wörld ∑ 🙂\n"
    ids = encode(text)
    assert ids.dtype == np.int64
    assert ids.tolist() == list(text.encode("utf-8"))
    assert decode(ids) == text
    assert VOCAB_SIZE == EOD + 1 == 257


def test_tokenizer_shows_end_of_document_and_bad_bytes():
    ids = np.concatenate([encode("a"), [EOD], encode("b"), [0xFF]])
    assert decode(ids) == f"a{EOD_TEXT}b\ufffd"
    with pytest.raises(ValueError, match="token ids"):
        decode([VOCAB_SIZE])


# ---- bundled corpus ----


def test_bundled_corpus_is_an_indexed_dataset_of_stdlib_files(tmp_path):
    prefix = build_corpus(str(tmp_path))
    sources = stdlib_sources()
    data = IndexedDataset(prefix)

    assert len(sources) > 500
    root = Path(sysconfig.get_paths()["stdlib"])
    assert all(EXCLUDED_DIRS.isdisjoint(path.relative_to(root).parts) for path in sources)
    assert len(data) == len(sources)
    assert data.document_indices.tolist() == list(range(len(sources) + 1))  # one document per file
    assert data[0].dtype == np.uint16
    assert int(data.sequence_lengths.sum()) == sum(path.stat().st_size + 1 for path in sources)

    first = data[0]
    assert first[-1] == EOD and EOD not in first[:-1]
    assert decode(first[:-1]) == sources[0].read_text(encoding="utf-8")
    non_ascii = next(k for k, path in enumerate(sources) if not path.read_bytes().isascii())
    assert decode(data[non_ascii][:-1]) == sources[non_ascii].read_text(encoding="utf-8")


def test_bundled_corpus_is_built_once_then_reused(tmp_path, capsys):
    prefix = build_corpus(str(tmp_path))
    log = capsys.readouterr().out
    assert "building the bundled corpus" in log and "documents" in log and "tokens in" in log
    mtimes = [os.stat(get_bin_path(prefix)).st_mtime_ns, os.stat(get_idx_path(prefix)).st_mtime_ns]

    assert build_corpus(str(tmp_path)) == prefix
    make_dataset(bundled(tmp_path), seq_length=64, vocab_size=VOCAB_SIZE, seed=0)
    assert capsys.readouterr().out == ""
    assert [os.stat(get_bin_path(prefix)).st_mtime_ns, os.stat(get_idx_path(prefix)).st_mtime_ns] == mtimes
    assert len(list(tmp_path.iterdir())) == 1  # no build directories left behind


def test_a_build_that_loses_the_race_keeps_the_winners_copy(tmp_path, monkeypatch):
    real_write = corpus._write_corpus

    def write_while_a_rival_finishes_first(prefix, final_dir):
        real_write(prefix, final_dir)
        monkeypatch.setattr(corpus, "_write_corpus", real_write)
        build_corpus(str(tmp_path))  # the rival renames its copy into place before we do

    monkeypatch.setattr(corpus, "_write_corpus", write_while_a_rival_finishes_first)
    prefix = build_corpus(str(tmp_path))
    assert len(IndexedDataset(prefix)) == len(stdlib_sources())
    assert len(list(tmp_path.iterdir())) == 1


def test_processes_starting_together_all_get_the_corpus(tmp_path):
    # Forked (megatron-core already imported) and released together by a barrier, so the builds overlap.
    context = multiprocessing.get_context("fork")
    barrier, results = context.Barrier(2), context.Queue()

    def build():
        barrier.wait()
        results.put(build_corpus(str(tmp_path)))

    processes = [context.Process(target=build) for _ in range(2)]
    for process in processes:
        process.start()
    prefixes = {results.get(timeout=20) for _ in processes}
    for process in processes:
        process.join(timeout=20)
    assert [process.exitcode for process in processes] == [0, 0]
    (prefix,) = prefixes
    assert len(IndexedDataset(prefix)) == len(stdlib_sources())
    assert len(list(tmp_path.iterdir())) == 1


def test_bundled_corpus_serves_text_windows(tmp_path):
    data = make_dataset(bundled(tmp_path), seq_length=128, vocab_size=VOCAB_SIZE, seed=0)
    tokens = IndexedDataset(build_corpus(str(tmp_path)))  # kept alive: its arrays are views of its mmap
    total = int(tokens.sequence_lengths.sum())
    assert len(data) == total // 129
    sample = data[0]
    assert sample.shape == (129,) and sample.dtype == np.int64
    assert sample.max() < VOCAB_SIZE


# ---- packed windows over an indexed dataset ----


def test_windows_follow_the_concatenated_stream_and_cover_each_once_per_epoch(handmade):
    cfg, stream, document_ends = handmade
    data = make_dataset(cfg, seq_length=7, vocab_size=1000, seed=3)
    n = len(stream) // 8
    assert len(data) == n
    windows = stream[: n * 8].reshape(n, 8)
    window_of = {row.tobytes(): k for k, row in enumerate(windows)}
    assert len(window_of) == n  # random tokens: every window is distinct, so a sample names its window
    assert any(end % 8 for end in document_ends[:-1])  # some windows do span a document boundary

    orders = []
    for epoch in range(3):
        order = [window_of[data[epoch * n + j].tobytes()] for j in range(n)]
        assert sorted(order) == list(range(n))
        orders.append(order)
    assert orders[0] != list(range(n))  # shuffled
    assert orders[0] != orders[1] != orders[2]  # and reshuffled every epoch


def test_samples_are_a_function_of_seed_and_index(handmade):
    cfg, _, _ = handmade
    data = make_dataset(cfg, seq_length=7, vocab_size=1000, seed=3)
    indices = [0, 5, len(data) + 2, 7 * len(data) + 1, 10**15]
    first = [data[i] for i in indices]

    resumed = make_dataset(cfg, seq_length=7, vocab_size=1000, seed=3)
    for i, sample in zip(reversed(indices), reversed(first)):  # a fresh object, read out of order
        np.testing.assert_array_equal(resumed[i], sample)
    copied = pickle.loads(pickle.dumps(data))  # as a DataLoader worker receives it
    np.testing.assert_array_equal(copied[indices[2]], first[2])

    other_seed = make_dataset(cfg, seq_length=7, vocab_size=1000, seed=4)
    assert any(not np.array_equal(other_seed[i], data[i]) for i in range(len(data)))
    with pytest.raises(IndexError):
        data[-1]


def test_token_ids_past_the_model_vocabulary_fail_with_the_fix(handmade, tmp_path):
    cfg, stream, _ = handmade
    data = make_dataset(cfg, seq_length=7, vocab_size=int(stream.max()) + 1, seed=0)
    for i in range(len(data)):
        data[i]
    too_small = make_dataset(cfg, seq_length=7, vocab_size=500, seed=0)
    with pytest.raises(ConfigError, match="model.vocab_size is 500.*vocab_size >"):
        for i in range(len(too_small)):
            too_small[i]

    empty_cache = tmp_path / "cache"
    with pytest.raises(ConfigError, match=f"bundled corpus.*token id {EOD}.*model.vocab_size is 256"):
        make_dataset(bundled(empty_cache), seq_length=16, vocab_size=256, seed=0)
    assert not empty_cache.exists()  # failed before building anything


def test_missing_dataset_names_the_expected_files(tmp_path):
    prefix = tmp_path / "nowhere" / "tokens"
    with pytest.raises(ConfigError) as error:
        make_dataset(DataConfig(name="x", path=str(prefix)), seq_length=8, vocab_size=100, seed=0)
    assert f"{prefix}.bin" in str(error.value) and f"{prefix}.idx" in str(error.value)
    with pytest.raises(ConfigError) as error:
        make_dataset(DataConfig(name="x", path=f"{prefix}.bin"), seq_length=8, vocab_size=100, seed=0)
    assert f"the prefix without the extension: {prefix}." in str(error.value)


def _truncate_bin(prefix: str) -> None:
    bin_path = Path(f"{prefix}.bin")
    bin_path.write_bytes(bin_path.read_bytes()[: bin_path.stat().st_size // 2])


def _random_idx(prefix: str) -> None:
    Path(f"{prefix}.idx").write_bytes(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes())


def _negative_lengths(prefix: str) -> None:
    """A valid header and the right size, but the sequence lengths (int32s right after the 34-byte header)
    overwritten with negative numbers: megatron-core reads it and a run trained on it."""
    idx_path = Path(f"{prefix}.idx")
    data = bytearray(idx_path.read_bytes())
    data[34:34 + 4 * 10] = np.full(10, -7, dtype=np.int32).tobytes()
    idx_path.write_bytes(bytes(data))


def _truncated_idx(prefix: str) -> None:
    idx_path = Path(f"{prefix}.idx")
    idx_path.write_bytes(idx_path.read_bytes()[:-8])


def _shorter_length(prefix: str) -> None:
    """The first sequence's length one token short: still positive and inside the .bin, but its end is no longer
    where the second sequence starts."""
    idx_path = Path(f"{prefix}.idx")
    data = bytearray(idx_path.read_bytes())
    first = int(np.frombuffer(bytes(data[34:38]), np.int32)[0])
    data[34:38] = np.array([first - 1], dtype=np.int32).tobytes()
    idx_path.write_bytes(bytes(data))


def _longer_bin(prefix: str) -> None:
    with open(f"{prefix}.bin", "ab") as file:
        file.write(b"\0" * 64)


@pytest.mark.parametrize("damage, file, what", [
    (_truncate_bin, "idx", "points past the end of"),
    (_random_idx, "idx", "is not a Megatron index"),
    (_negative_lengths, "idx", "negative sequence length"),
    (_truncated_idx, "idx", "truncated or damaged"),
    (_shorter_length, "idx", "sequence 1 starts at byte"),
    (_longer_bin, "bin", "belongs to another index"),
])
def test_a_damaged_dataset_is_refused_naming_the_file(handmade, damage, file, what):
    cfg, _, _ = handmade
    make_dataset(cfg, seq_length=8, vocab_size=1000, seed=0)  # intact: opens
    damage(cfg.path)
    with pytest.raises(ConfigError) as error:
        make_dataset(cfg, seq_length=8, vocab_size=1000, seed=0)
    message = str(error.value)
    assert f"{cfg.path}.{file}" in message and what in message and "\n" not in message, message
    assert "rebuild the dataset" in message


def test_a_dataset_shorter_than_one_sample_fails(handmade):
    cfg, stream, _ = handmade
    with pytest.raises(ConfigError, match="fewer than one sample"):
        make_dataset(cfg, seq_length=len(stream), vocab_size=1000, seed=0)


# ---- mock ----


def test_mock_tokens_are_uniform_in_the_vocabulary_and_deterministic():
    cfg = DataConfig(name="mock", kind=DataKind.mock)
    data = make_dataset(cfg, seq_length=63, vocab_size=7, seed=1)
    samples = np.stack([data[i] for i in range(100)])
    assert samples.shape == (100, 64) and samples.dtype == np.int64
    assert set(np.unique(samples).tolist()) == set(range(7))
    np.testing.assert_array_equal(make_dataset(cfg, seq_length=63, vocab_size=7, seed=1)[42], samples[42])
    assert not np.array_equal(samples[0], samples[1])
    assert not np.array_equal(make_dataset(cfg, seq_length=63, vocab_size=7, seed=2)[0], samples[0])
    assert data[10**18].shape == (64,)
    assert len(data) >= 10**18


def test_a_single_data_option_resolves_its_cache_directory(monkeypatch):
    """conf/data/text.yaml names its cache with OmegaConf's `${oc.env:...}`; load_option (tools that do not
    compose with Hydra) resolves it the same way instead of handing on the literal text."""
    monkeypatch.setenv("FP8_RECIPES_CACHE", "/somewhere/cache")
    assert load_option("data", "text").cache_dir == "/somewhere/cache"
    monkeypatch.delenv("FP8_RECIPES_CACHE")
    assert load_option("data", "text").cache_dir == "~/.cache/fp8-recipes"
