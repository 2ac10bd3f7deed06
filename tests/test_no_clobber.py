"""Never delete or overwrite what unbroken did not create.

Every place the library removes, empties or overwrites a path a user named: ``selftest --workdir``,
``demo --workdir`` (``run_demo``), ``export --to`` (a file, an HF folder, a checkpoint folder),
``import`` into a folder, and the Lightning ``UnbrokenCheckpointIO`` (overwrite and remove). Each
takes only what it made (marked), refuses anything else with a message that says what to do, and
leaves the user's files byte for byte as they were.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import unbroken
from unbroken.cli import app
from unbroken.selftest import protocol

SCRIPTS = Path(__file__).parent / "selftest_scripts"


@pytest.fixture(autouse=True)
def _no_selftest_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    for name in (protocol.DIR, protocol.RUN, protocol.KILL, protocol.STOP, "UNBROKEN_FAULTS"):
        monkeypatch.delenv(name, raising=False)


def marker(tool: str) -> str:
    return f".unbroken-{tool}"


def cli(*args: str) -> tuple[int, str, str]:
    res = CliRunner().invoke(app, list(args))
    if res.exception is not None and not isinstance(res.exception, SystemExit):
        raise res.exception
    return res.exit_code, res.stdout, res.stderr


def project(root: Path) -> dict[str, bytes]:
    """A user's project folder: a few files and a sub-folder; returns what they hold."""
    (root / "src").mkdir(parents=True)
    files = {"train.py": b"print('my training')\n", "README.md": b"# mine\n", "src/model.py": b"W = 1\n"}
    for name, data in files.items():
        (root / name).write_bytes(data)
    return files


def unchanged(root: Path, files: dict[str, bytes]) -> bool:
    return all((root / n).read_bytes() == d for n, d in files.items())


# ------------------------------------------------------------------------------------- selftest
def test_selftest_refuses_a_workdir_it_did_not_make(tmp_path: Path) -> None:
    """``--workdir .`` used to empty the user's project before the first run."""
    files = project(tmp_path / "proj")
    code, out, err = cli("selftest", "--steps", "3", "--kills", "0", "--timeout", "60", "--json",
                         "--workdir", str(tmp_path / "proj"), "--", sys.executable, str(SCRIPTS / "no_checkpointer.py"))
    doc = json.loads(out)
    assert code == 2 and doc["verdict"] == "error", (doc, err)
    assert "not empty" in doc["error"] and marker("selftest") in doc["error"] and "nothing was changed" in doc["error"]
    assert doc["workdir"] is None and doc["reference"] is None  # the script never ran
    assert unchanged(tmp_path / "proj", files) and sorted(os.listdir(tmp_path / "proj")) == ["README.md", "src",
                                                                                             "train.py"]


def test_selftest_reuses_its_own_workdir_and_removes_only_its_entries(tmp_path: Path) -> None:
    work = tmp_path / "w"
    args = ("selftest", "--steps", "3", "--kills", "0", "--timeout", "60", "--json", "--workdir", str(work), "--",
            sys.executable, str(SCRIPTS / "no_checkpointer.py"))
    assert cli(*args)[0] == 2  # no Checkpointer: could not run, but the folder is made and marked
    assert (work / marker("selftest")).is_file() and (work / "uninterrupted").is_dir()
    (work / "uninterrupted" / "stale").write_text("from the last selftest")
    (work / "notes.txt").write_text("the user's note beside the runs")
    code, out, _ = cli(*args)
    assert code == 2 and "no Checkpointer" in json.loads(out)["error"]
    assert not (work / "uninterrupted" / "stale").exists()  # its own run folder was replaced
    assert (work / "notes.txt").read_text() == "the user's note beside the runs"


def test_claim_workdir_refuses_a_file_a_foreign_tool_folder_and_a_link_to_a_project(tmp_path: Path) -> None:
    from unbroken.errors import TargetExistsError
    from unbroken.selftest.workdir import claim_workdir

    (tmp_path / "file").write_text("x")
    with pytest.raises(TargetExistsError, match="not a folder"):
        claim_workdir(tmp_path / "file", "selftest", ["interrupted"])
    demo_dir = claim_workdir(tmp_path / "d", "demo", ["interrupted"])
    (demo_dir / "interrupted").mkdir()
    with pytest.raises(TargetExistsError, match="not a folder that unbroken selftest made"):
        claim_workdir(demo_dir, "selftest", ["interrupted"])
    assert (demo_dir / "interrupted").is_dir()
    files = project(tmp_path / "proj")
    (tmp_path / "link").symlink_to(tmp_path / "proj")
    with pytest.raises(TargetExistsError):
        claim_workdir(tmp_path / "link", "selftest", ["src"])
    assert unchanged(tmp_path / "proj", files)
    # a link planted among a marked folder's entries is unlinked, its target untouched
    work = claim_workdir(tmp_path / "w", "selftest", ["interrupted"])
    (work / "interrupted").symlink_to(tmp_path / "proj")
    claim_workdir(work, "selftest", ["interrupted"])
    assert not os.path.lexists(work / "interrupted") and unchanged(tmp_path / "proj", files)
    # new and empty folders are taken
    (tmp_path / "empty").mkdir()
    assert (claim_workdir(tmp_path / "empty", "demo", []) / marker("demo")).is_file()
    assert (claim_workdir(tmp_path / "new" / "deeper", "demo", []) / marker("demo")).is_file()


# ----------------------------------------------------------------------------------------- demo
def test_demo_refuses_a_workdir_it_did_not_make(tmp_path: Path) -> None:
    files = project(tmp_path / "proj")
    code, out, err = cli("demo", "--workdir", str(tmp_path / "proj"), "--steps", "20", "--kills", "1", "--seed", "1")
    assert code == 2, (out, err)
    assert "TargetExistsError" in err and "not empty" in err and "unbroken demo" in err
    assert unchanged(tmp_path / "proj", files) and sorted(os.listdir(tmp_path / "proj")) == ["README.md", "src",
                                                                                             "train.py"]
    from unbroken.demo import run_demo
    from unbroken.errors import TargetExistsError

    with pytest.raises(TargetExistsError):
        run_demo(str(tmp_path / "proj"), steps=20, kills=1, seed=1)
    assert unchanged(tmp_path / "proj", files)


# --------------------------------------------------------------------------------------- export
def a_run(root: Path) -> Path:
    """A run with one checkpoint of a small model."""
    ckpt = unbroken.Checkpointer(root, keep_last=None, preemption=None)
    torch.manual_seed(0)
    ckpt.save({"model": torch.nn.Linear(3, 2).state_dict()})
    ckpt.close()
    return root


def export(*args: str) -> tuple[int, str, str]:
    return cli("export", *args)


def test_export_refuses_an_existing_file_unless_force(tmp_path: Path) -> None:
    run = a_run(tmp_path / "run")
    mine = tmp_path / "weights.safetensors"
    mine.write_bytes(b"the user's own file")
    code, _, err = export(str(run), "--to", str(mine))
    assert code == 1 and "TargetExistsError" in err and "--force" in err, err
    assert mine.read_bytes() == b"the user's own file"
    code, out, err = export(str(run), "--to", str(mine), "--force")
    assert code == 0, err
    from safetensors.torch import load_file

    assert set(load_file(mine)) == {"weight", "bias"}


def test_export_never_writes_inside_a_checkpoint_even_with_force(tmp_path: Path) -> None:
    """``--to`` a file of the checkpoint being exported used to overwrite it: the checkpoint was broken."""
    run = a_run(tmp_path / "run")
    [name] = [p.name for p in run.iterdir() if p.name.startswith("step-")]
    ckpt = run / name
    before = {p.name: p.read_bytes() for p in ckpt.iterdir()}
    tensor_file = next(n for n in before if n.endswith(".safetensors") and "model" in n)
    for target, extra in ((ckpt / "new.safetensors", []), (ckpt / "sub" / "w.safetensors", []),
                          (ckpt / tensor_file, ["--force"])):
        code, _, err = export(str(run), "--to", str(target), *extra)
        assert code == 1 and "TargetExistsError" in err and "inside the checkpoint" in err, (target, err)
    code, _, err = export(str(run), "--to", str(ckpt), "--format", "hf", "--config", str(tmp_path / "none.json"))
    assert code == 1 and "TargetExistsError" in err, err
    assert {p.name: p.read_bytes() for p in ckpt.iterdir()} == before
    unbroken.verify(ckpt)
    # nor into a run: a checkpoint folder exported into a run would become its newest checkpoint
    code, _, err = export(str(run), "--to", str(run / "copy"), "--format", "checkpoint")
    assert code == 1 and "in the run" in err, err
    code, _, err = export(str(run), "--to", str(run / "index.sqlite"), "--force")
    assert code == 1 and "a file of the run" in err, err
    assert sorted(p.name for p in run.iterdir()) == sorted([name, ".lock", "index.sqlite"])


def test_export_does_not_follow_a_link_at_the_target(tmp_path: Path) -> None:
    run = a_run(tmp_path / "run")
    mine = tmp_path / "precious.bin"
    mine.write_bytes(b"precious")
    link = tmp_path / "out.safetensors"
    link.symlink_to(mine)
    code, _, err = export(str(run), "--to", str(link))
    assert code == 1 and "symbolic link" in err, err
    code, _, err = export(str(run), "--to", str(link), "--force")  # replaces the link, not what it points to
    assert code == 0, err
    assert mine.read_bytes() == b"precious" and not link.is_symlink() and link.stat().st_size > 100
    # an HF folder given as a link is refused, with or without --force
    (tmp_path / "proj").mkdir()
    (tmp_path / "hf").symlink_to(tmp_path / "proj")
    cfg = tmp_path / "config.json"
    cfg.write_text("{}")
    for extra in ([], ["--force"]):
        code, _, err = export(str(run), "--to", str(tmp_path / "hf"), "--format", "hf", "--config", str(cfg), *extra)
        assert code == 1 and "symbolic link" in err, err
    assert os.listdir(tmp_path / "proj") == []


def test_export_hf_keeps_the_files_of_an_existing_folder(tmp_path: Path) -> None:
    run = a_run(tmp_path / "run")
    release = tmp_path / "release"
    release.mkdir()
    (release / "config.json").write_text('{"mine": true}')
    (release / "tokenizer.json").write_text("{}")
    cfg = tmp_path / "config.json"
    cfg.write_text('{"model_type": "x"}')
    code, _, err = export(str(run), "--to", str(release), "--format", "hf", "--config", str(cfg))
    assert code == 1 and "config.json exists" in err, err
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "model.safetensors").write_bytes(b"the user's weights")
    code, _, err = export(str(run), "--to", str(tmp_path / "other"), "--format", "hf", "--config", str(cfg))
    assert code == 1 and "model.safetensors exists" in err, err
    assert (tmp_path / "other" / "model.safetensors").read_bytes() == b"the user's weights"
    assert os.listdir(tmp_path / "other") == ["model.safetensors"]
    assert (release / "config.json").read_text() == '{"mine": true}' and not (release / "model.safetensors").exists()
    code, _, err = export(str(run), "--to", str(release), "--format", "hf", "--config", str(cfg), "--force")
    assert code == 0, err
    assert json.loads((release / "config.json").read_text()) == {"model_type": "x"}
    assert (release / "tokenizer.json").read_text() == "{}"  # what export does not write stays
    # a file where the folder goes, a folder where the file goes: never replaced, --force or not
    code, _, err = export(str(run), "--to", str(release / "tokenizer.json"), "--format", "hf", "--config", str(cfg),
                          "--force")
    assert code == 1 and "is a file" in err, err
    code, _, err = export(str(run), "--to", str(release), "--force")
    assert code == 1 and "is a folder" in err, err
    # --format checkpoint never replaces a folder
    (tmp_path / "copy").mkdir()
    (tmp_path / "copy" / "keep").write_text("x")
    code, _, err = export(str(run), "--to", str(tmp_path / "copy"), "--format", "checkpoint")
    assert code == 1 and "never replaces" in err, err
    assert os.listdir(tmp_path / "copy") == ["keep"]


# ---------------------------------------------------------------------- Lightning checkpoint_io
def lightning_checkpoint(step: int) -> dict:
    return {"state_dict": {"w": torch.full((3,), float(step))}, "global_step": step, "epoch": 0}


def test_lightning_checkpoint_io_overwrites_and_removes_only_its_own(tmp_path: Path, caplog) -> None:
    from unbroken.integrations.lightning import UnbrokenCheckpointIO

    io = UnbrokenCheckpointIO()
    torch_ckpt = tmp_path / "last.ckpt"  # a TorchCheckpointIO file of an earlier run
    torch.save(lightning_checkpoint(7), torch_ckpt)
    before = torch_ckpt.read_bytes()
    with pytest.raises(unbroken.UnbrokenError, match="not an unbroken checkpoint"):
        io.save_checkpoint(lightning_checkpoint(8), torch_ckpt)
    assert torch_ckpt.read_bytes() == before and not list(tmp_path.glob("*.unbroken-*"))
    # remove_checkpoint leaves what it did not write (a file, a folder of the user's), with a warning
    user_dir = tmp_path / "mine.ckpt"
    user_dir.mkdir()
    (user_dir / "notes.txt").write_text("keep")
    with caplog.at_level("WARNING", logger="unbroken"):
        io.remove_checkpoint(torch_ckpt)
        io.remove_checkpoint(user_dir)
    assert torch_ckpt.read_bytes() == before and (user_dir / "notes.txt").read_text() == "keep"
    assert caplog.text.count("not removing") == 2
    with pytest.raises(unbroken.UnbrokenError, match="not an unbroken checkpoint"):
        io.save_checkpoint(lightning_checkpoint(8), user_dir)
    assert os.listdir(user_dir) == ["notes.txt"]
    # its own checkpoints: replaced and removed as before; a link is unlinked, its target untouched
    ours = tmp_path / "epoch_0-step_1.ckpt"
    io.save_checkpoint(lightning_checkpoint(1), ours)
    io.save_checkpoint(lightning_checkpoint(2), ours)
    assert io.load_checkpoint(ours)["global_step"] == 2
    link = tmp_path / "best.ckpt"
    link.symlink_to(user_dir)
    io.remove_checkpoint(link)
    assert not os.path.lexists(link) and (user_dir / "notes.txt").read_text() == "keep"
    link.symlink_to(user_dir)
    io.save_checkpoint(lightning_checkpoint(3), link)  # Lightning's save_last="link" leaves such links
    assert not link.is_symlink() and io.load_checkpoint(link)["global_step"] == 3
    assert (user_dir / "notes.txt").read_text() == "keep"
    io.remove_checkpoint(ours)
    assert not ours.exists()


def test_lightning_checkpoint_io_on_s3_removes_only_its_own(s3, s3_url: str) -> None:
    from unbroken.integrations.lightning import UnbrokenCheckpointIO

    io = UnbrokenCheckpointIO(storage_options=s3.storage_options)
    fs = s3.fs()
    foreign = f"{s3_url}/last.ckpt"
    fs.pipe(foreign.removeprefix("s3://") + "/data.bin", b"someone else's")
    with pytest.raises(unbroken.UnbrokenError, match="not an unbroken checkpoint"):
        io.save_checkpoint(lightning_checkpoint(1), foreign)
    io.remove_checkpoint(foreign)
    assert fs.cat(foreign.removeprefix("s3://") + "/data.bin") == b"someone else's"
    ours = f"{s3_url}/epoch_0-step_1.ckpt"
    io.save_checkpoint(lightning_checkpoint(1), ours)
    io.save_checkpoint(lightning_checkpoint(2), ours)
    assert io.load_checkpoint(ours)["global_step"] == 2  # a ".ckpt" URL it saved is read back as its own
    io.remove_checkpoint(ours)
    fs.invalidate_cache()
    key = ours.removeprefix("s3://")
    assert [f for f in fs.find(key) if f != key] == []  # (SeaweedFS may keep an empty folder entry)
