"""``unbroken export --format hf`` on a run written by the HF Trainer integration: no ``--config``
needed, since the integration records the model's config; ``from_pretrained`` loads the folder
into the model the run trained, bitwise."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from test_cli import invoke

import transformers  # noqa: F401 - in the test extra: a missing one fails, never skips
SCRIPT = Path(__file__).with_name("hf_train.py")


@pytest.fixture(scope="module")
def hf_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor], dict]:
    """A 4-step run of tests/hf_train.py's tiny GPT-2 through ``unbroken.integrations.hf.enable``
    (in this process): the run, the trained weights and the model's config."""
    sys.path.insert(0, str(SCRIPT.parent))
    import hf_train
    from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments, set_seed

    from unbroken.integrations.hf import enable

    out = tmp_path_factory.mktemp("hf-run")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        set_seed(7)
        model = GPT2LMHeadModel(GPT2Config(vocab_size=hf_train.VOCAB, n_positions=hf_train.SEQ, n_embd=32,
                                           n_layer=2, n_head=2))
        args = TrainingArguments(output_dir=str(out / "hf"), per_device_train_batch_size=4, max_steps=4,
                                 learning_rate=3e-3, report_to=[], use_cpu=True, disable_tqdm=True, seed=7,
                                 save_strategy="no")
        trainer = hf_train.ScriptTrainer(model=model, args=args, train_dataset=hf_train.Tokens())
        enable(trainer, out / "run", save_every=2, keep_last=None)
        trainer.train()
    finally:
        torch.set_num_threads(threads)
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return out / "run", weights, model.config.to_dict()


def test_export_hf_of_an_integration_run_needs_no_config(hf_run, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    run, weights, config = hf_run
    res = invoke("export", run, "--to", tmp_path / "release", "--format", "hf", "--json")
    assert res.exit_code == 0, res.output
    assert sorted(Path(f).name for f in json.loads(res.stdout)["files"]) == ["config.json", "model.safetensors"]
    saved = json.loads((tmp_path / "release" / "config.json").read_text())
    assert saved["model_type"] == "gpt2" and saved["architectures"] == ["GPT2LMHeadModel"]
    assert {k: saved[k] for k in ("n_embd", "n_layer", "n_head", "vocab_size")} == \
        {k: config[k] for k in ("n_embd", "n_layer", "n_head", "vocab_size")}
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "release")
    assert type(loaded).__name__ == "GPT2LMHeadModel"
    got = loaded.state_dict()
    assert got.keys() == weights.keys()
    for name, t in weights.items():
        assert torch.equal(got[name].view(torch.uint8), t.view(torch.uint8)), name  # bitwise

    # an older step of the run exports too (every checkpoint records the config)
    res = invoke("export", run / "step-000000002", "--to", tmp_path / "step2", "--format", "hf")
    assert res.exit_code == 0, res.output
    assert json.loads((tmp_path / "step2" / "config.json").read_text())["n_layer"] == 2


def test_export_hf_without_any_config_says_what_to_do(tmp_path: Path) -> None:
    import unbroken

    unbroken.save(tmp_path / "run" / "ckpt", {"model": {"w": torch.zeros(2)}})
    res = invoke("export", tmp_path / "run" / "ckpt", "--to", tmp_path / "out", "--format", "hf")
    assert res.exit_code == 1 and "records no HF model config" in res.output and "--config" in res.output
    assert not (tmp_path / "out" / "model.safetensors").exists()
