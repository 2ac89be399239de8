"""Corpus selection: deterministic, deduplicated, filtered, split by name, capped, recorded."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from train.corpus import (
    HELDOUT_LIST_NAME,
    MANIFEST_NAME,
    Corpus,
    CorpusConfig,
    build_corpus,
    default_roots,
    is_heldout,
    read_text,
)

CONFIG = CorpusConfig(heldout_fraction=0.2, min_file_bytes=100)


def test_same_files_every_time_and_split_by_name(corpus_root: Path) -> None:
    a = build_corpus(CONFIG, [("src", corpus_root)])
    b = build_corpus(CONFIG, [("src", corpus_root)])
    assert [(f.name, f.sha256, f.heldout) for f in a.files] == [
        (f.name, f.sha256, f.heldout) for f in b.files
    ]
    assert a.train_files and a.heldout_files
    assert all(f.heldout == is_heldout(f.name, 0.2) for f in a.files)
    assert {f.name for f in a.train_files}.isdisjoint({f.name for f in a.heldout_files})


def test_choice_does_not_depend_on_where_the_files_live(corpus_root: Path, tmp_path: Path) -> None:
    moved = tmp_path / "elsewhere" / "deeper" / "pkg"
    shutil.copytree(corpus_root, moved)
    a = build_corpus(CONFIG, [("src", corpus_root)])
    b = build_corpus(CONFIG, [("src", moved)])
    assert [(f.name, f.heldout) for f in a.files] == [(f.name, f.heldout) for f in b.files]


def test_duplicates_non_utf8_generated_and_tiny_files_are_dropped(corpus_root: Path) -> None:
    original = corpus_root / "sub0" / "mod_000.py"
    (corpus_root / "copy_of_mod_000.py").write_bytes(original.read_bytes())
    (corpus_root / "latin1.py").write_bytes(b"# caf\xe9\n" + b"x = 1\n" * 50)
    (corpus_root / "table.py").write_text("DATA = [" + "1, " * 2000 + "]\n")
    (corpus_root / "tiny.py").write_text("x = 1\n")
    (corpus_root / "notes.txt").write_text("not python\n" * 100)
    corpus = build_corpus(CONFIG, [("src", corpus_root)])
    names = {f.name for f in corpus.files}
    assert len({f.sha256 for f in corpus.files}) == len(corpus.files)
    assert ("src/sub0/mod_000.py" in names) != ("src/copy_of_mod_000.py" in names)
    assert not names & {"src/latin1.py", "src/table.py", "src/tiny.py", "src/notes.txt"}
    assert corpus.stats["duplicates"] == 1
    assert corpus.stats["non_utf8_or_generated"] == 2


def test_cap_limits_training_bytes(corpus_root: Path) -> None:
    full = build_corpus(CONFIG, [("src", corpus_root)])
    cap = full.stats["train_bytes"] // 2
    capped = build_corpus(
        CorpusConfig(heldout_fraction=0.2, min_file_bytes=100, max_train_bytes=cap),
        [("src", corpus_root)],
    )
    assert 0 < capped.stats["train_bytes"] <= cap
    assert capped.stats["train_bytes"] == sum(f.num_bytes for f in capped.train_files)
    # the cap drops training files, not the held-out split
    assert {f.name for f in capped.heldout_files} == {f.name for f in full.heldout_files}


def test_manifest_round_trip_and_heldout_list(corpus_root: Path, tmp_path: Path) -> None:
    corpus = build_corpus(CONFIG, [("src", corpus_root)])
    corpus.save(tmp_path / "m")
    manifest = json.loads((tmp_path / "m" / MANIFEST_NAME).read_text())
    assert {f["name"] for f in manifest["files"]} == {f.name for f in corpus.files}
    listed = (tmp_path / "m" / HELDOUT_LIST_NAME).read_text().splitlines()
    assert sorted(line.split("\t")[0] for line in listed) == sorted(
        f.name for f in corpus.heldout_files
    )
    again = Corpus.load(tmp_path / "m")
    assert again.files == corpus.files and again.config == corpus.config


def test_read_text_refuses_a_changed_file(corpus_root: Path) -> None:
    corpus = build_corpus(CONFIG, [("src", corpus_root)])
    file = corpus.files[0]
    assert "UNIQUE" in read_text(file)
    Path(file.path).write_text("changed = True\n" * 20)
    with pytest.raises(ValueError, match="changed"):
        read_text(file)


def test_nested_root_is_walked_once(tmp_path: Path) -> None:
    outer = tmp_path / "lib"
    inner = outer / "site-packages"
    for folder, name in ((outer / "json", "a.py"), (inner / "pkg", "b.py")):
        folder.mkdir(parents=True)
        (folder / name).write_text(f"# {name}\n" + "value = 1\n" * 30)
    corpus = build_corpus(CONFIG, [("stdlib", outer), ("site-packages", inner)])
    assert sorted(f.name for f in corpus.files) == ["site-packages/pkg/b.py", "stdlib/json/a.py"]


def test_default_roots_are_the_installed_stdlib_and_site_packages() -> None:
    roots = default_roots()
    assert roots[0][0] == "stdlib" and (roots[0][1] / "json" / "__init__.py").is_file()
    assert any(label.startswith("site-packages") for label, _ in roots[1:])


def test_no_files_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no training files"):
        build_corpus(CONFIG, [("empty", tmp_path)])
