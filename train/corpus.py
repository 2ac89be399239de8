"""The training corpus: the Python sources installed on the training machine.

Sources are the interpreter's standard library (with its test suite where present) and the
installed site-packages, found through ``sysconfig`` and ``site``; nothing is downloaded.

Terms:
- *name*: a file's stable identifier, ``<root label>/<path relative to the root>`` (for example
  ``stdlib/json/decoder.py`` or ``site-packages/torch/nn/functional.py``). Every deterministic
  choice hashes the name, never the absolute path, so two machines with the same packages at
  different prefixes pick the same files.
- *held-out*: a fixed fraction of files chosen by the hash of their name; training never sees them.
- *cap*: the corpus keeps files in a deterministic pseudo-random order (hash of the name) until
  ``max_train_bytes`` is reached, so a cap samples evenly across packages instead of keeping the
  alphabetically first ones.
- duplicates: a file whose content hash was already taken (vendored copies) is dropped.
"""

from __future__ import annotations

import hashlib
import json
import os
import site
import sysconfig
from dataclasses import asdict, dataclass, field
from pathlib import Path

MANIFEST_NAME = "corpus_manifest.json"
HELDOUT_LIST_NAME = "heldout_files.txt"
_SKIP_DIRS = frozenset({"__pycache__", "site-packages", "dist-packages", ".git", ".hg", ".tox"})


@dataclass(frozen=True)
class CorpusConfig:
    """Which files make the corpus. Byte sizes are of the UTF-8 file content."""

    max_train_bytes: int = 200_000_000
    min_file_bytes: int = 200
    max_file_bytes: int = 300_000
    max_line_chars: int = 1000  # longer lines mark generated data tables, minified code
    heldout_fraction: float = 0.02
    max_heldout_bytes: int = 8_000_000

    def __post_init__(self) -> None:
        if not 0.0 < self.heldout_fraction < 0.5:
            raise ValueError(f"heldout_fraction must be in (0, 0.5), got {self.heldout_fraction}")
        if self.max_train_bytes <= 0 or self.max_heldout_bytes <= 0:
            raise ValueError("max_train_bytes and max_heldout_bytes must be positive")
        if not 0 <= self.min_file_bytes < self.max_file_bytes:
            raise ValueError("need 0 <= min_file_bytes < max_file_bytes")


@dataclass(frozen=True)
class SourceFile:
    name: str  # "<root label>/<relative path>", see the module docstring
    path: str  # absolute path on the machine that built the corpus
    sha256: str  # of the file's bytes
    num_bytes: int
    heldout: bool


@dataclass
class Corpus:
    roots: list[tuple[str, str]]  # (label, absolute path)
    config: CorpusConfig
    files: list[SourceFile]
    stats: dict[str, int] = field(default_factory=dict)

    @property
    def train_files(self) -> list[SourceFile]:
        return [f for f in self.files if not f.heldout]

    @property
    def heldout_files(self) -> list[SourceFile]:
        return [f for f in self.files if f.heldout]

    def save(self, folder: Path) -> None:
        """Write the manifest (every file's name, path, hash, size, split) and the held-out list."""
        folder.mkdir(parents=True, exist_ok=True)
        manifest = {
            "format": "mtpserve-corpus-v1",
            "roots": [{"label": label, "path": path} for label, path in self.roots],
            "config": asdict(self.config),
            "stats": self.stats,
            "files": [asdict(f) for f in self.files],
        }
        (folder / MANIFEST_NAME).write_text(json.dumps(manifest, indent=0) + "\n")
        (folder / HELDOUT_LIST_NAME).write_text(
            "".join(f"{f.name}\t{f.sha256}\n" for f in self.heldout_files)
        )

    @classmethod
    def load(cls, folder: Path) -> Corpus:
        data = json.loads((folder / MANIFEST_NAME).read_text())
        return cls(
            roots=[(r["label"], r["path"]) for r in data["roots"]],
            config=CorpusConfig(**data["config"]),
            files=[SourceFile(**f) for f in data["files"]],
            stats=data["stats"],
        )


def default_roots() -> list[tuple[str, Path]]:
    """The standard library first, then each site-packages folder, labelled and deduplicated."""
    candidates: list[tuple[str, str]] = [("stdlib", sysconfig.get_paths()["stdlib"])]
    site_dirs: list[str] = []
    site_dirs += site.getsitepackages() if hasattr(site, "getsitepackages") else []
    site_dirs += [sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]
    if site.ENABLE_USER_SITE:
        site_dirs.append(site.getusersitepackages())
    for i, path in enumerate(dict.fromkeys(site_dirs)):
        candidates.append(("site-packages" if i == 0 else f"site-packages-{i}", path))
    roots: list[tuple[str, Path]] = []
    seen: set[Path] = set()
    for label, path in candidates:
        resolved = Path(path).resolve()
        if resolved.is_dir() and resolved not in seen:
            seen.add(resolved)
            roots.append((label, resolved))
    return roots


def name_fraction(name: str, salt: str) -> float:
    """A deterministic number in [0, 1) from a file's name (the same on every machine)."""
    digest = hashlib.sha256(f"{salt}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


def is_heldout(name: str, fraction: float) -> bool:
    return name_fraction(name, "heldout") < fraction


def _candidates(roots: list[tuple[str, Path]], config: CorpusConfig) -> list[tuple[str, Path, int]]:
    """Every ``*.py`` file under the roots within the size limits: (name, path, size)."""
    other_roots = {path for _, path in roots}
    found: list[tuple[str, Path, int]] = []
    for label, root in roots:
        for dirpath, dirnames, filenames in os.walk(root):
            here = Path(dirpath)
            # Prune caches, VCS folders and nested roots (a site-packages inside the stdlib).
            dirnames[:] = sorted(
                d
                for d in dirnames
                if d not in _SKIP_DIRS and not d.startswith(".") and (here / d) not in other_roots
            )
            for filename in sorted(filenames):
                if not filename.endswith(".py"):
                    continue
                path = here / filename
                try:
                    if path.is_symlink() or not path.is_file():
                        continue
                    size = path.stat().st_size
                except OSError:
                    continue
                if config.min_file_bytes <= size <= config.max_file_bytes:
                    found.append((f"{label}/{path.relative_to(root).as_posix()}", path, size))
    return found


def _read_source(path: Path, config: CorpusConfig) -> bytes | None:
    """The file's bytes if it is UTF-8 text that looks like hand-written code, else None."""
    try:
        data = path.read_bytes()
        text = data.decode("utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    if (
        "\x00" in text
        or max((len(line) for line in text.splitlines()), default=0) > config.max_line_chars
    ):
        return None
    return data


def build_corpus(config: CorpusConfig, roots: list[tuple[str, Path]] | None = None) -> Corpus:
    """Choose the corpus files deterministically: filter, deduplicate by content, split, cap.

    Files are visited in the order of a hash of their name; the first file with a given content
    hash is kept. Training and held-out files are capped separately, so the held-out set stays
    about ``heldout_fraction`` of the files whatever the cap.
    """
    roots = default_roots() if roots is None else [(lbl, Path(p).resolve()) for lbl, p in roots]
    if not roots:
        raise ValueError("no corpus roots found")
    candidates = _candidates(roots, config)
    candidates.sort(key=lambda c: (name_fraction(c[0], "order"), c[0]))
    stats = {"candidates": len(candidates), "non_utf8_or_generated": 0, "duplicates": 0}
    seen_hashes: set[str] = set()
    files: list[SourceFile] = []
    used = {False: 0, True: 0}  # bytes taken, by heldout flag
    limit = {False: config.max_train_bytes, True: config.max_heldout_bytes}
    for name, path, size in candidates:
        heldout = is_heldout(name, config.heldout_fraction)
        if used[heldout] + size > limit[heldout]:
            if used[not heldout] + config.min_file_bytes > limit[not heldout]:
                break  # both splits are full
            continue
        data = _read_source(path, config)
        if data is None:
            stats["non_utf8_or_generated"] += 1
            continue
        digest = hashlib.sha256(data).hexdigest()
        if digest in seen_hashes:
            stats["duplicates"] += 1
            continue
        seen_hashes.add(digest)
        used[heldout] += len(data)
        files.append(SourceFile(name, str(path), digest, len(data), heldout))
    if not any(not f.heldout for f in files):
        raise ValueError(f"no training files found under {[str(p) for _, p in roots]}")
    stats.update(
        train_files=sum(not f.heldout for f in files),
        heldout_files=sum(f.heldout for f in files),
        train_bytes=used[False],
        heldout_bytes=used[True],
    )
    return Corpus([(lbl, str(p)) for lbl, p in roots], config, files, stats)


def read_text(file: SourceFile) -> str:
    """A corpus file's text; raises ValueError if it changed since the manifest was made."""
    data = Path(file.path).read_bytes()
    if hashlib.sha256(data).hexdigest() != file.sha256:
        raise ValueError(f"corpus file changed since the manifest was built: {file.name}")
    return data.decode("utf-8")
