"""``unbroken import`` / ``export`` (issue 14): real HF Trainer folders and Lightning ``.ckpt`` files
written by those libraries in the test, imported, verified, resumed; a malicious pickle refused
without running; weights exported to safetensors and to an HF folder that ``from_pretrained`` reads."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import unbroken
from unbroken.convert import UntrustedPickleError, export_weights, import_checkpoint, read_source

import pytorch_lightning as pl  # the test extra installs both: a missing one fails, not skips
import transformers


def _tiny_gpt2() -> transformers.GPT2LMHeadModel:
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=64, n_positions=16)
    return transformers.GPT2LMHeadModel(config)


class _Tokens(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 32

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = torch.arange(i, i + 8) % 64
        return {"input_ids": ids, "labels": ids}


def _args(out: Path) -> transformers.TrainingArguments:
    return transformers.TrainingArguments(output_dir=str(out), max_steps=3, save_strategy="steps", save_steps=3,
                                          per_device_train_batch_size=4, learning_rate=1e-3, warmup_steps=1,
                                          report_to=[], use_cpu=True, disable_tqdm=True, logging_strategy="no")


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A checkpoint-3 folder written by a real transformers.Trainer (AdamW, linear schedule)."""
    out = tmp_path_factory.mktemp("hf")
    transformers.Trainer(model=_tiny_gpt2(), args=_args(out), train_dataset=_Tokens()).train()
    return out / "checkpoint-3"


def test_an_hf_trainer_folder_imports_verified_and_resumes(hf_folder: Path, tmp_path: Path) -> None:
    assert {"model.safetensors", "optimizer.pt", "scheduler.pt", "trainer_state.json"} <= \
        {p.name for p in hf_folder.iterdir()}
    info, imported = import_checkpoint(hf_folder, tmp_path / "run")
    assert imported.kind == "hf" and info.step == 3 and info.progress["step"] == 3
    assert any("training_args.bin" in note for note in imported.left_out)
    unbroken.verify(info.path)
    tree = unbroken.load(tmp_path / "run")
    saved = load_file(hf_folder / "model.safetensors")
    assert set(saved) <= set(tree["model"]) and all(torch.equal(saved[k], tree["model"][k]) for k in saved)
    hf_optim = torch.load(hf_folder / "optimizer.pt", weights_only=True)
    assert torch.equal(tree["optimizer"]["state"][0]["exp_avg"], hf_optim["state"][0]["exp_avg"])
    assert tree["trainer_state"]["global_step"] == 3 and tree["config"]["n_embd"] == 16

    # resume from the import: a plain loop continues from step 3 with the HF optimizer and schedule
    model = _tiny_gpt2()
    for p in model.parameters():
        p.data.zero_()
    # the optimizer's parameter groups as HF builds them
    trainer = transformers.Trainer(model=model, args=_args(tmp_path))
    opt = trainer.create_optimizer()
    sched = trainer.create_scheduler(3, opt)
    state = {"model": model, "optimizer": opt, "scheduler": sched}
    with unbroken.Checkpointer(tmp_path / "run", strict=False) as ckpt:
        assert ckpt.restore(state).step == 3
        assert torch.equal(model.transformer.wte.weight, saved["transformer.wte.weight"])
        assert sched.last_epoch == 3 and opt.state_dict()["state"][0]["step"] == hf_optim["state"][0]["step"]
        torch.manual_seed(1)
        batch = _Tokens()[0]
        loss = model(input_ids=batch["input_ids"][None], labels=batch["labels"][None]).loss
        loss.backward()
        opt.step()
        sched.step()
        ckpt.step(state, loss=loss)
        assert ckpt.progress.step == 4 and torch.isfinite(loss)


class _Tiny(pl.LightningModule):
    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Linear(width, 1)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], _: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        opt = torch.optim.Adam(self.parameters(), lr=1e-2)
        return [opt], [torch.optim.lr_scheduler.StepLR(opt, 2)]


def test_a_lightning_ckpt_imports_and_resumes(tmp_path: Path) -> None:
    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(32, 8), torch.randn(32, 1))
    trainer = pl.Trainer(max_steps=10, accelerator="cpu", logger=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=str(tmp_path), enable_checkpointing=False)
    module = _Tiny()
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=4))
    trainer.save_checkpoint(tmp_path / "last.ckpt")
    info, imported = import_checkpoint(tmp_path / "last.ckpt", tmp_path / "run")
    assert imported.kind == "lightning" and info.step == 10
    tree = unbroken.load(tmp_path / "run")
    assert torch.equal(tree["model"]["net.weight"], module.net.weight.detach())
    assert tree["lightning"]["global_step"] == 10 and tree["hyper_parameters"] == {"width": 8}
    fresh = _Tiny()
    opt = torch.optim.Adam(fresh.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, 2)
    with unbroken.Checkpointer(tmp_path / "run", strict=False) as ckpt:
        ckpt.restore({"model": fresh, "optimizer": opt, "scheduler": sched})
        assert torch.equal(fresh.net.weight, module.net.weight)
        assert sched.state_dict() == trainer.lr_scheduler_configs[0].scheduler.state_dict()
        assert sched.last_epoch == 1  # StepLR steps per epoch (8 batches): one epoch done by step 10
        assert ckpt.progress.step == 10 and ckpt.progress.epoch == tree["lightning"]["epoch"]
        assert opt.state_dict()["state"][0]["exp_avg"].abs().sum() > 0


def test_torch_save_files_import(tmp_path: Path) -> None:
    model = torch.nn.Linear(3, 2)
    torch.save(model.state_dict(), tmp_path / "weights.pt")
    info, _ = import_checkpoint(tmp_path / "weights.pt", tmp_path / "a")
    assert info.step == 0 and torch.equal(unbroken.load(info.path)["model"]["weight"], model.weight.detach())
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": 7}, tmp_path / "parts.pt")
    info, _ = import_checkpoint(tmp_path / "parts.pt", tmp_path / "b")
    tree = unbroken.load(info.path)
    assert info.step == 7 and torch.equal(tree["optimizer"]["state"][0]["momentum_buffer"],
                                          opt.state_dict()["state"][0]["momentum_buffer"])


_EVIL = textwrap.dedent("""
    import os, sys, torch

    class Evil:
        def __reduce__(self):
            return (os.system, ("touch " + sys.argv[2],))

    torch.save({"model": {"w": torch.zeros(2)}, "payload": Evil()}, sys.argv[1])
""")


def test_a_malicious_pickle_is_refused_and_runs_nothing(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    subprocess.run([sys.executable, "-c", _EVIL, str(tmp_path / "evil.pt"), str(marker)], check=True, timeout=120)
    assert not marker.exists()
    with pytest.raises(UntrustedPickleError) as e:
        read_source(tmp_path / "evil.pt")
    assert "system" in str(e.value) and "--trust-pickle" in str(e.value)
    assert not marker.exists(), "refusing must not run the payload"
    assert not (tmp_path / "run").exists()
    with pytest.raises(UntrustedPickleError):
        import_checkpoint(tmp_path / "evil.pt", tmp_path / "run")
    assert not marker.exists() and not (tmp_path / "run").exists()


def test_export_safetensors_cast_and_hf_folder(hf_folder: Path, tmp_path: Path) -> None:
    info, _ = import_checkpoint(hf_folder, tmp_path / "run")
    [out] = export_weights(info.path, tmp_path / "model.safetensors", dtype="bf16")
    weights = load_file(out)
    original = load_file(hf_folder / "model.safetensors")
    assert all(weights[k].dtype == torch.bfloat16 for k in original if original[k].is_floating_point())
    assert all(torch.equal(weights[k], original[k].to(torch.bfloat16)) for k in original)
    files = export_weights(tmp_path / "run", tmp_path / "hf", fmt="hf")
    assert sorted(f.name for f in files) == ["config.json", "model.safetensors"]
    model = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf")
    assert torch.equal(model.transformer.wte.weight, original["transformer.wte.weight"])
    with pytest.raises(unbroken.errors.UnbrokenError, match="no part 'nope'"):
        export_weights(info.path, tmp_path / "x.safetensors", key="nope")
    with pytest.raises(unbroken.errors.UnbrokenError, match="unknown dtype"):
        export_weights(info.path, tmp_path / "x.safetensors", dtype="int8")
    assert not (tmp_path / "x.safetensors").exists()


def test_import_refuses_sources_it_does_not_know(tmp_path: Path) -> None:
    (tmp_path / "folder").mkdir()
    with pytest.raises(unbroken.errors.UnbrokenError, match="not an HF Trainer checkpoint folder"):
        read_source(tmp_path / "folder")
    torch.save([1, 2, 3], tmp_path / "list.pt")
    with pytest.raises(unbroken.errors.UnbrokenError, match="not a dict"):
        read_source(tmp_path / "list.pt")
    with pytest.raises(unbroken.errors.UnbrokenError, match="does not exist"):
        read_source(tmp_path / "missing.ckpt")
    assert sorted(os.listdir(tmp_path)) == ["folder", "list.pt"]


# ------------------------------------------------------------------ the commands
def test_import_and_export_commands(hf_folder: Path, tmp_path: Path) -> None:
    import json

    from typer.testing import CliRunner

    from unbroken.cli import app

    runner = CliRunner()
    res = runner.invoke(app, ["import", str(hf_folder), str(tmp_path / "run"), "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["kind"] == "hf" and doc["step"] == 3 and doc["rng"] is True
    assert {"model", "optimizer", "scheduler", "trainer_state", "config"} <= set(doc["parts"])
    assert unbroken.verify(doc["checkpoint"]).step == 3
    res = runner.invoke(app, ["import", str(hf_folder), str(tmp_path / "run2")])
    assert res.exit_code == 0 and "imported hf checkpoint" in res.stdout and "left out: training_args.bin" in res.stdout

    res = runner.invoke(app, ["export", str(tmp_path / "run"), "--to", str(tmp_path / "w.safetensors"),
                              "--dtype", "fp16", "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["files"] == [str(tmp_path / "w.safetensors")]
    assert load_file(tmp_path / "w.safetensors")["transformer.wte.weight"].dtype == torch.float16
    res = runner.invoke(app, ["export", doc["checkpoint"], "--to", str(tmp_path / "hf"), "--format", "hf"])
    assert res.exit_code == 0 and (tmp_path / "hf" / "config.json").is_file(), res.output
    res = runner.invoke(app, ["export", doc["checkpoint"], "--to", str(tmp_path / "x"), "--key", "nope"])
    assert res.exit_code == 1 and "no part 'nope'" in res.output


def test_import_command_refuses_a_malicious_pickle(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    subprocess.run([sys.executable, "-c", _EVIL, str(tmp_path / "evil.pt"), str(marker)], check=True, timeout=120)
    unbroken_cli = str(Path(sys.executable).parent / "unbroken")
    res = subprocess.run([unbroken_cli, "import", str(tmp_path / "evil.pt"), str(tmp_path / "run")],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 1 and "UntrustedPickleError" in res.stderr and "--trust-pickle" in res.stderr
    assert "Traceback" not in res.stderr
    assert not marker.exists() and not (tmp_path / "run").exists()


# ------------------------------------------------------------------ bounded import (issue 23 §7)
def _shared_pickle(path: Path, levels: int) -> None:
    """A tiny pickle whose list holds the same list twice, ``levels`` deep: 2**(levels+1) - 1 values
    once written out as a tree."""
    shared: list = []
    for _ in range(levels):
        shared = [shared, shared]
    torch.save({"model": {"w": torch.zeros(2)}, "optimizer": shared}, path)


@pytest.mark.parametrize("levels", [20, 30])
def test_shared_references_are_walked_once_and_bounded(tmp_path: Path, levels: int) -> None:
    """A 2 KB pickle of shared references: 2**31 values written out. Refused at once, not after minutes."""
    _shared_pickle(tmp_path / "shared.pt", levels)
    assert (tmp_path / "shared.pt").stat().st_size < 4096
    with pytest.raises(unbroken.errors.UnbrokenError, match="more than 2,000,000 values"):
        read_source(tmp_path / "shared.pt")
    with pytest.raises(unbroken.errors.UnbrokenError, match="more than 2,000,000 values"):
        import_checkpoint(tmp_path / "shared.pt", tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_cycles_and_deep_nesting_in_a_pickle_are_refused_clearly(tmp_path: Path) -> None:
    cycle: list = [1]
    cycle.append(cycle)
    torch.save({"model": {"w": torch.zeros(2)}, "extra": cycle}, tmp_path / "cycle.pt")
    with pytest.raises(unbroken.errors.UnbrokenError, match="contains itself"):
        read_source(tmp_path / "cycle.pt")
    deep: list = []
    for _ in range(150):
        deep = [deep]
    torch.save({"model": {"w": torch.zeros(2)}, "extra": deep}, tmp_path / "deep.pt")
    with pytest.raises(unbroken.errors.UnbrokenError, match="more than 100 levels"):
        read_source(tmp_path / "deep.pt")
    # sharing that stays small (tied weights, a list used twice) imports as before, as copies
    small = [1, 2]
    torch.save({"model": {"a": torch.ones(2)}, "extra": {"x": small, "y": small}}, tmp_path / "ok.pt")
    assert read_source(tmp_path / "ok.pt").state["extra"] == {"x": [1, 2], "y": [1, 2]}


def _hostile_hf(hf_folder: Path, tmp_path: Path, name: str, text: str) -> Path:
    import shutil

    folder = tmp_path / "checkpoint-3"
    shutil.copytree(hf_folder, folder)
    (folder / name).write_text(text)
    return folder


def _gpt2_config(hf_folder: Path, **changes: object) -> str:
    import json

    config = json.loads((hf_folder / "config.json").read_text())
    config.update(changes)
    return json.dumps(config)


@pytest.mark.parametrize("name,text,message", [
    ("config.json", "n_layer=2000", "declares n_layer = 2000"),
    ("config.json", "n_layer=200000", "declares n_layer = 200000"),
    ("config.json", "[1, 2]", "holds a JSON list, not an object"),
    ("config.json", "[" * 100_000 + "]" * 100_000, "is not valid JSON"),
    ("config.json", "n_layer='two'", "transformers cannot build GPT2LMHeadModel"),
    ("trainer_state.json", '"step 3"', "holds a JSON str, not an object"),
    ("model.safetensors.index.json", '{"weight_map": 5}', "'weight_map' is not an object of file names"),
], ids=["2000-layers", "200000-layers", "config-list", "config-deep", "config-bad-value", "state-string",
        "index-bad-map"])
def test_hostile_hf_metadata_gives_a_clear_error(hf_folder: Path, tmp_path: Path, name: str, text: str,
                                                 message: str) -> None:
    """An HF config claiming 200,000 layers used to build them all on the meta device (minutes); other
    hostile metadata raised TypeError, AttributeError or RecursionError from deep inside."""
    if "=" in text and not text.startswith(("[", "{", '"')):
        key, value = text.split("=")
        text = _gpt2_config(hf_folder, **{key: eval(value)})
    folder = _hostile_hf(hf_folder, tmp_path, name, text)
    with pytest.raises(unbroken.errors.UnbrokenError, match=message) as e:
        import_checkpoint(folder, tmp_path / "run")
    assert name in str(e.value)
    assert not (tmp_path / "run").exists()


def test_import_refuses_a_folder_that_is_not_a_run(tmp_path: Path) -> None:
    """``unbroken import SRC .`` used to turn the user's project into a run (lock, index, checkpoint)."""
    torch.save({"w": torch.ones(2)}, tmp_path / "w.pt")
    project = tmp_path / "project"
    project.mkdir()
    (project / "train.py").write_text("print('mine')\n")
    with pytest.raises(unbroken.errors.UnbrokenError, match="not a run"):
        import_checkpoint(tmp_path / "w.pt", project)
    assert os.listdir(project) == ["train.py"]
    info, _ = import_checkpoint(tmp_path / "w.pt", tmp_path / "run")  # a new folder becomes a run
    with pytest.raises(unbroken.errors.UnbrokenError, match="is a checkpoint"):
        import_checkpoint(tmp_path / "w.pt", info.path)  # never into a checkpoint
    again, _ = import_checkpoint(tmp_path / "w.pt", tmp_path / "run")  # a run takes another one
    assert again.path != info.path
    unbroken.verify(info.path)


@pytest.mark.parametrize("step", [float("inf"), float("nan"), -3, 2.5, 2**60])
def test_a_step_that_is_not_a_count_is_refused_not_committed(tmp_path: Path, step: float) -> None:
    """An infinite, NaN, negative, fractional or absurd step in a source is refused with the value named,
    before anything is written (issue 33 §5: before, inf raised a raw OverflowError, and NaN or a
    negative step became step 0 silently)."""
    torch.save({"model": {"w": torch.zeros(2)}, "step": step}, tmp_path / "ckpt.pt")
    with pytest.raises(unbroken.errors.UnbrokenError, match=r"its step is .*not a count from 0"):
        import_checkpoint(tmp_path / "ckpt.pt", tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_a_tiny_pickle_of_an_expanded_tensor_is_refused_not_written_out_at_full_size(tmp_path: Path) -> None:
    """One element expanded to 10**8 pickles in about 1.5 KB; written out it would be a 400 MB checkpoint
    (issue 33 §5): refused, naming the shape. A small broadcast view (HF's position_ids) still imports."""
    torch.save({"model": {"w": torch.zeros(1).expand(10**8)}}, tmp_path / "big.pt")
    assert (tmp_path / "big.pt").stat().st_size < 4096
    with pytest.raises(unbroken.errors.UnbrokenError, match=r"expanded beyond the bytes behind them.*100000000"):
        import_checkpoint(tmp_path / "big.pt", tmp_path / "run")
    assert not (tmp_path / "run").exists()
    torch.save({"model": {"position_ids": torch.arange(512).expand((1, -1)), "w": torch.ones(2)}},
               tmp_path / "ok.pt")
    info, _ = import_checkpoint(tmp_path / "ok.pt", tmp_path / "run")
    assert info.step == 0


def test_a_deepspeed_file_named_for_rank_a_billion_is_refused_without_allocating(tmp_path: Path) -> None:
    """The ranks of a DeepSpeed folder are bounded by the files present: a file claiming rank 10**9
    used to build a list of 10**9 ranks (gigabytes, then a raw MemoryError) (issue 33 §5)."""
    from unbroken.convert.deepspeed import _rank_files

    for rank in (0, 10**9):
        (tmp_path / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt").write_bytes(b"")
    with pytest.raises(unbroken.errors.UnbrokenError, match=r"lacks the optimizer file of rank 1 \(files of 2 "
                                                            r"ranks, the highest 1000000000\)"):
        _rank_files(tmp_path)
