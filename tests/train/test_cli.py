"""End to end on a tiny corpus: `python -m train` writes a loadable DeepSeek-V3 folder, learns,
never trains on held-out files, and resumes exactly after a crash."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from engine import LLMEngine, SamplingParams, SpecConfig
from tests.train.conftest import marker
from train.cli import main
from train.data import WindowSampler
from train.presets import TINY


def _run(corpus_root: Path, out: Path, *extra: str) -> None:
    argv = ["--preset", "tiny", "--out", str(out), "--device", "cpu", "--no-progress"]
    argv += ["--corpus-root", f"src={corpus_root}", "--joint-steps", "24", "--distill-steps", "6"]
    assert main(argv + list(extra)) == 0


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for shard in sorted(folder.glob("model-*.safetensors")):
        out.update(load_file(str(shard)))
    return out


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.train.conftest import write_corpus

    root = write_corpus(tmp_path_factory.mktemp("src"))
    out = tmp_path_factory.mktemp("run") / "model"
    torch.set_num_threads(1)
    _run(root, out)
    return out


def test_folder_is_complete_and_loads_everywhere(trained: Path) -> None:
    for name in (
        "config.json",
        "generation_config.json",
        "model.safetensors.index.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "corpus_manifest.json",
        "heldout_files.txt",
        "training_log.json",
    ):
        assert (trained / name).is_file(), name
    config = json.loads((trained / "config.json").read_text())
    L, k = config["num_hidden_layers"], config["num_nextn_predict_layers"]
    weights = _weights(trained)
    for i in range(k):
        assert f"model.layers.{L + i}.eh_proj.weight" in weights
        assert weights[f"model.layers.{L + i}.eh_proj.weight"].shape == (
            TINY.hidden_size,
            2 * TINY.hidden_size,
        )
    log = json.loads((trained / "training_log.json").read_text())
    assert log["export"]["weight_bytes"] == sum(
        p.stat().st_size for p in trained.glob("*.safetensors")
    )
    assert all(p.stat().st_size <= TINY.max_shard_bytes for p in trained.glob("*.safetensors"))

    tok = AutoTokenizer.from_pretrained(str(trained))
    ids = tok("def compute_alpha(items):\n").input_ids
    hf = AutoModelForCausalLM.from_pretrained(str(trained), dtype=torch.float32)
    assert hf(torch.tensor([ids])).logits.shape == (1, len(ids), TINY.vocab_size)
    eng = LLMEngine.from_pretrained(
        str(trained), device="cpu", dtype="float32", spec=SpecConfig(method="tree")
    )
    greedy = eng.generate(
        prompt_token_ids=[ids], sampling=SamplingParams(max_tokens=12, temperature=0.0)
    )
    plain = LLMEngine.from_pretrained(
        str(trained), device="cpu", dtype="float32", spec=SpecConfig(method="none")
    )
    reference = plain.generate(
        prompt_token_ids=[ids], sampling=SamplingParams(max_tokens=12, temperature=0.0)
    )
    assert greedy[0].token_ids == reference[0].token_ids
    assert greedy[0].stats.num_accepted_tokens > 0


def test_training_lowers_heldout_loss_and_distillation_raises_agreement(trained: Path) -> None:
    log = json.loads((trained / "training_log.json").read_text())
    history = log["history"]
    start = history[0]
    assert (start["phase"], start["step"]) == ("joint", 0)
    joint_end = [h for h in history if h["phase"] == "joint"][-1]
    assert joint_end["heldout"]["main_loss"] < start["heldout"]["main_loss"] - 0.5
    assert log["final_heldout"]["mtp_kl"][0] <= joint_end["heldout"]["mtp_kl"][0] + 1e-6
    assert log["phases"]["joint"]["steps"] == 24 and log["phases"]["distill"]["steps"] == 6


def test_heldout_files_never_reach_training_windows(trained: Path) -> None:
    work = trained.with_name(trained.name + ".work") / "data"
    tok = AutoTokenizer.from_pretrained(str(trained))
    manifest = json.loads((trained / "corpus_manifest.json").read_text())
    heldout = {f["name"] for f in manifest["files"] if f["heldout"]}
    listed = {
        line.split("\t")[0] for line in (trained / "heldout_files.txt").read_text().splitlines()
    }
    assert heldout == listed and heldout
    number = {f["name"]: int(f["name"].rsplit("_", 1)[1][:3]) for f in manifest["files"]}
    train_stream = np.load(work / "train.npy")
    sampler = WindowSampler(train_stream, TINY.seq_len, TINY.batch_size, 0, torch.device("cpu"))
    seen = "".join(tok.decode(sampler.batch(step).flatten().tolist()) for step in range(30))
    full = tok.decode(train_stream.tolist())
    for name, i in number.items():
        if name in heldout:
            assert marker(i) not in full and marker(i) not in seen, name
        else:
            assert marker(i) in full, name


def test_resume_after_a_crash_gives_the_same_model(
    trained: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = Path(json.loads((trained / "corpus_manifest.json").read_text())["roots"][0]["path"])
    out = tmp_path / "model"
    original = WindowSampler.batch
    calls = {"n": 0}

    def crash_after_ten(self: WindowSampler, step: int) -> torch.Tensor:
        calls["n"] += 1
        if calls["n"] > 10:
            raise KeyboardInterrupt("simulated crash")
        return original(self, step)

    monkeypatch.setattr(WindowSampler, "batch", crash_after_ten)
    with pytest.raises(KeyboardInterrupt):
        _run(root, out, "--ckpt-every-s", "0")
    monkeypatch.setattr(WindowSampler, "batch", original)
    _run(root, out, "--ckpt-every-s", "0", "--resume")
    resumed, uninterrupted = _weights(out), _weights(trained)
    assert resumed.keys() == uninterrupted.keys()
    for name in resumed:
        torch.testing.assert_close(resumed[name], uninterrupted[name], rtol=0, atol=0)


def test_time_budget_covers_data_preparation_and_both_phases(tmp_path: Path) -> None:
    from tests.train.conftest import write_corpus

    root = write_corpus(tmp_path / "src")
    out = tmp_path / "model"
    argv = ["--preset", "tiny", "--out", str(out), "--device", "cpu", "--no-progress"]
    assert main(argv + ["--corpus-root", str(root), "--time-budget-s", "12"]) == 0
    log = json.loads((out / "training_log.json").read_text())
    assert log["timings_s"]["total_s"] < 12 + 3  # export after the budget takes a moment
    joint, distill = log["phases"]["joint"], log["phases"]["distill"]
    assert joint["steps"] > 0 and distill["steps"] > 0
    assert distill["elapsed_s"] >= 0.5 * TINY.distill_frac * joint["elapsed_s"]
