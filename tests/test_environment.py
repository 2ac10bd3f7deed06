"""``unbroken.checkpointer.environment``: what a fingerprint records (versions, git, config, data), how
two fingerprints are diffed and classified, and what each ``check`` policy does."""

from __future__ import annotations

import argparse
import copy
import dataclasses
import enum
import importlib.metadata
import json
import logging
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import unbroken
from unbroken.checkpointer import environment as envmod
from unbroken.checkpointer.environment import (
    MISSING,
    Change,
    check,
    diff,
    fingerprint,
    format_changes,
)
from unbroken.errors import EnvironmentMismatchError, UnbrokenError

needs_git = pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@example.com",
                           "-c", "commit.gpgsign=false", *args],
                          cwd=repo, check=True, capture_output=True, text=True).stdout.strip()


@pytest.fixture(autouse=True)
def _isolated(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # no WORLD_SIZE/RANK from the caller; git must not find a repository above tmp_path
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    r = tmp_path / "repo"
    r.mkdir()
    git(r, "init", "-q", "-b", "main")
    (r / "train.py").write_text("lr = 0.001\n")
    git(r, "add", "train.py")
    git(r, "commit", "-q", "-m", "first")
    return r


@pytest.fixture(scope="module")
def base() -> dict[str, Any]:
    """A realistic recorded fingerprint that the diff tests mutate."""
    env = fingerprint(config={"lr": 0.001, "batch": 32, "model": {"depth": 4}}, data="dataset-v1")
    env.update(git={"commit": "a" * 40, "branch": "main", "dirty": False, "diff_hash": None},
               cuda="12.1", cudnn=90100, gpus=["NVIDIA H100 80GB HBM3"],
               packages={"torchvision": "0.19.0", "transformers": "4.44.0"})
    return env


def changed(base: dict[str, Any], **edits: Any) -> list[Change]:
    """diff(base, base with ``edits`` applied; dotted keys reach into nested dicts)."""
    current = copy.deepcopy(base)
    for dotted, value in edits.items():
        *parents, last = dotted.split("__")
        node = current
        for p in parents:
            node = node[p]
        if value is MISSING:
            del node[last]
        else:
            node[last] = value
    return diff(base, current)


# ------------------------------------------------------------------- fingerprint
def test_fingerprint_records_versions_and_is_json(tmp_path: Path) -> None:
    env = fingerprint(cwd=tmp_path)
    assert env["unbroken"] == unbroken.__version__
    assert env["torch"] == torch.__version__
    assert env["numpy"] == np.__version__
    assert env["safetensors"] == importlib.metadata.version("safetensors")
    assert env["xxhash"] == importlib.metadata.version("xxhash")
    assert env["cuda"] == torch.version.cuda
    expected = {}
    for name in envmod.KEY_PACKAGES:
        try:
            expected[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    assert env["packages"] == expected
    assert env["world_size"] == 1 and env["rank"] == 0
    assert env["git"] is None and env["config"] is None and env["data"] is None
    assert isinstance(env["host"], str) and isinstance(env["platform"], str)
    if torch.cuda.is_available():
        assert len(env["gpus"]) == torch.cuda.device_count()
    else:
        assert env["gpus"] == []
    assert json.loads(json.dumps(env, allow_nan=False)) == env


def test_world_size_from_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "2")
    env = fingerprint(cwd=tmp_path)
    assert (env["world_size"], env["rank"]) == (4, 2)


@needs_git
def test_git_clean_dirty_staged_untracked_and_committed(repo: Path) -> None:
    clean = fingerprint(cwd=repo)["git"]
    assert clean == {"commit": git(repo, "rev-parse", "HEAD"), "branch": "main",
                     "dirty": False, "diff_hash": None}

    (repo / "notes.txt").write_text("untracked files do not count\n")
    assert fingerprint(cwd=repo)["git"] == clean

    (repo / "train.py").write_text("lr = 0.002\n")
    dirty = fingerprint(cwd=repo)["git"]
    assert dirty["dirty"] is True and dirty["commit"] == clean["commit"]
    assert isinstance(dirty["diff_hash"], str) and len(dirty["diff_hash"]) == 32

    git(repo, "add", "train.py")  # staged: same change against HEAD, same hash
    assert fingerprint(cwd=repo)["git"] == dirty

    (repo / "train.py").write_text("lr = 0.003\n")  # staged + a further unstaged edit
    dirtier = fingerprint(cwd=repo)["git"]
    assert dirtier["dirty"] is True and dirtier["diff_hash"] != dirty["diff_hash"]

    git(repo, "commit", "-q", "-am", "second")
    committed = fingerprint(cwd=repo)["git"]
    assert committed["commit"] != clean["commit"]
    assert committed["dirty"] is False and committed["diff_hash"] is None


@needs_git
def test_git_diff_hash_sees_binary_content(repo: Path) -> None:
    (repo / "table.bin").write_bytes(bytes(range(256)))
    git(repo, "add", "table.bin")
    git(repo, "commit", "-q", "-m", "binary")
    (repo / "table.bin").write_bytes(bytes(range(255, -1, -1)))
    one = fingerprint(cwd=repo)["git"]["diff_hash"]
    (repo / "table.bin").write_bytes(bytes(range(0, 256, 2)))
    assert fingerprint(cwd=repo)["git"]["diff_hash"] not in (None, one)


@needs_git
def test_git_detached_head_has_no_branch(repo: Path) -> None:
    git(repo, "checkout", "-q", "--detach")
    assert fingerprint(cwd=repo)["git"]["branch"] is None


def test_git_none_outside_a_repository(tmp_path: Path) -> None:
    assert fingerprint(cwd=tmp_path)["git"] is None


@needs_git
def test_git_none_without_a_commit(tmp_path: Path) -> None:
    git(tmp_path, "init", "-q")
    assert fingerprint(cwd=tmp_path)["git"] is None


def test_git_none_when_git_is_missing(repo: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    assert fingerprint(cwd=repo)["git"] is None


# -------------------------------------------------------------------------- data
def test_data_id_string_and_bytes() -> None:
    assert fingerprint(data="imagenet@v3")["data"] == {"hash": "imagenet@v3"}
    assert fingerprint(data=b"\x01\xab")["data"] == {"hash": "01ab"}


def test_data_files_change_with_size_and_mtime(tmp_path: Path) -> None:
    a, b = tmp_path / "a.bin", tmp_path / "b.bin"
    a.write_bytes(b"1234")
    b.write_bytes(b"xy")
    os.utime(a, (1_000_000_000, 1_000_000_000))
    first = fingerprint(data=[a, str(b)])["data"]
    assert first["files"][0] == {"path": str(a), "size": 4, "mtime": 1_000_000_000.0}
    assert first["count"] == 2 and first["truncated"] is False
    assert fingerprint(data=[a, str(b)])["data"] == first  # stable

    os.utime(a, (1_000_000_001, 1_000_000_001))  # same size, newer mtime
    touched = fingerprint(data=[a, str(b)])["data"]
    assert touched["hash"] != first["hash"]

    b.write_bytes(b"xyz")  # a different size
    grown = fingerprint(data=[a, str(b)])["data"]
    assert grown["files"][1]["size"] == 3 and grown["hash"] not in (first["hash"], touched["hash"])


def test_data_directory_is_walked_sorted_and_capped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    d = tmp_path / "ds"
    (d / "sub").mkdir(parents=True)
    for rel in ("b.txt", "a.txt", "sub/c.txt"):
        (d / rel).write_text(rel)
    data = fingerprint(data=d)["data"]  # a single os.PathLike
    assert [f["path"] for f in data["files"]] == [str(d / "a.txt"), str(d / "b.txt"), str(d / "sub" / "c.txt")]
    assert data["truncated"] is False

    (d / "sub" / "c.txt").write_text("longer now")
    assert fingerprint(data=d)["data"]["hash"] != data["hash"]

    monkeypatch.setattr(envmod, "MAX_DATA_FILES", 2)
    capped = fingerprint(data=d)["data"]
    assert capped["count"] == 2 and capped["truncated"] is True


def test_data_missing_path_is_recorded(tmp_path: Path) -> None:
    data = fingerprint(data=[tmp_path / "gone.bin"])["data"]
    assert data["files"] == [{"path": str(tmp_path / "gone.bin"), "size": None, "mtime": None}]


@pytest.mark.parametrize("bad", [42, [1, 2], {"path": "x"}, 3.5])
def test_data_of_another_type_is_a_type_error(bad: Any) -> None:
    with pytest.raises(TypeError, match="data must be"):
        fingerprint(data=bad)


# ------------------------------------------------------------------------ config
class Act(enum.Enum):
    RELU = "relu"


@dataclasses.dataclass
class Opt:
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)


def test_config_is_made_json_safe() -> None:
    config = {
        "lr": np.float32(0.5), "steps": np.int64(7), "flag": np.bool_(True), "warm": torch.tensor(3),
        "path": Path("/data/x"), "act": Act.RELU, "dtype": torch.bfloat16, "device": torch.device("cpu"),
        "sizes": (1, 2), "tags": {"b", "a"}, "bad": float("nan"), "big": float("inf"),
        "opt": Opt(), "layers": {0: "in", 1: "out"}, "none": None,
    }
    out = fingerprint(config=config)["config"]
    assert out == {
        "lr": 0.5, "steps": 7, "flag": True, "warm": 3, "path": "/data/x", "act": "Act.RELU",
        "dtype": "torch.bfloat16", "device": "cpu", "sizes": [1, 2], "tags": ["a", "b"],
        "bad": "nan", "big": "inf", "opt": {"lr": 0.001, "betas": [0.9, 0.999]},
        "layers": {"0": "in", "1": "out"}, "none": None,
    }
    json.dumps(out, allow_nan=False)


def test_config_from_dataclass_and_namespace() -> None:
    assert fingerprint(config=Opt())["config"] == {"lr": 0.001, "betas": [0.9, 0.999]}
    assert fingerprint(config=argparse.Namespace(lr=0.1, name="x"))["config"] == {"lr": 0.1, "name": "x"}


def test_config_with_an_opaque_object_names_its_path() -> None:
    with pytest.raises(TypeError, match=r"config\['model'\]\['act'\] is a ReLU"):
        fingerprint(config={"model": {"act": torch.nn.ReLU()}})
    with pytest.raises(TypeError, match=r"config\['w'\] is a Tensor"):
        fingerprint(config={"w": torch.ones(3)})


def test_config_must_be_a_mapping_and_keys_must_not_collide() -> None:
    with pytest.raises(TypeError, match="config must be a mapping"):
        fingerprint(config=[("lr", 0.1)])
    with pytest.raises(TypeError, match="two keys"):
        fingerprint(config={1: "a", "1": "b"})
    with pytest.raises(TypeError, match="key of type"):
        fingerprint(config={(1, 2): "a"})


# -------------------------------------------------------------------------- diff
def test_identical_fingerprints_have_no_changes(base: dict[str, Any]) -> None:
    assert diff(base, copy.deepcopy(base)) == []


def test_diff_git_commit(base: dict[str, Any]) -> None:
    assert changed(base, git__commit="b" * 40) == [Change("git.commit", "a" * 40, "b" * 40, "significant")]


def test_diff_git_dirty(base: dict[str, Any]) -> None:
    got = changed(base, git__dirty=True, git__diff_hash="f" * 32)
    assert got == [Change("git.diff_hash", None, "f" * 32, "significant"),
                   Change("git.dirty", False, True, "significant")]


def test_diff_git_branch_is_info_and_lost_repo_is_significant(base: dict[str, Any]) -> None:
    assert changed(base, git__branch="dev") == [Change("git.branch", "main", "dev", "info")]
    assert changed(base, git=None) == [Change("git", base["git"], None, "significant")]


def test_diff_python(base: dict[str, Any]) -> None:
    assert changed(base, python="3.99.0") == [Change("python", base["python"], "3.99.0", "significant")]


def test_diff_torch(base: dict[str, Any]) -> None:
    assert changed(base, torch="9.9.9") == [Change("torch", base["torch"], "9.9.9", "significant")]


def test_diff_numpy_and_unbroken(base: dict[str, Any]) -> None:
    assert [c.severity for c in changed(base, numpy="0.1", unbroken="0.0.1")] == ["significant"] * 2


def test_diff_key_package_changed_added_removed(base: dict[str, Any]) -> None:
    assert changed(base, packages__transformers="4.45.0") == [
        Change("packages.transformers", "4.44.0", "4.45.0", "significant")]
    assert changed(base, packages__lightning="2.4.0") == [
        Change("packages.lightning", MISSING, "2.4.0", "significant")]
    assert changed(base, packages__torchvision=MISSING) == [
        Change("packages.torchvision", "0.19.0", MISSING, "significant")]


def test_diff_format_only_packages_are_info(base: dict[str, Any]) -> None:
    assert [c.severity for c in changed(base, safetensors="0.1", xxhash="0.1")] == ["info", "info"]


def test_diff_cuda_fields(base: dict[str, Any]) -> None:
    assert changed(base, cuda="12.4") == [Change("cuda", "12.1", "12.4", "significant")]
    assert changed(base, cudnn=90300) == [Change("cudnn", 90100, 90300, "significant")]
    assert changed(base, cuda=None, cudnn=None, gpus=[]) == [  # moved to a CPU-only machine
        Change("cuda", "12.1", None, "significant"), Change("cudnn", 90100, None, "significant"),
        Change("gpus", ["NVIDIA H100 80GB HBM3"], [], "info")]


def test_diff_config_changed_added_removed(base: dict[str, Any]) -> None:
    assert changed(base, config__lr=0.002) == [Change("config.lr", 0.001, 0.002, "significant")]
    assert changed(base, config__model__depth=6) == [Change("config.model.depth", 4, 6, "significant")]
    assert changed(base, config__warmup=100) == [Change("config.warmup", MISSING, 100, "significant")]
    assert changed(base, config__batch=MISSING) == [Change("config.batch", 32, MISSING, "significant")]
    assert changed(base, config=None) == [Change("config", base["config"], None, "significant")]


def test_diff_bool_and_int_are_different() -> None:
    # True == 1 in Python, but a flag that became a count is a different hyperparameter
    assert diff({"config": {"x": 1}}, {"config": {"x": True}}) == [Change("config.x", 1, True, "significant")]
    assert diff({"config": {"x": 32}}, {"config": {"x": 32.0}}) == []  # the same value


def test_diff_data_id(base: dict[str, Any]) -> None:
    assert changed(base, data={"hash": "dataset-v2"}) == [
        Change("data.hash", "dataset-v1", "dataset-v2", "significant")]


def test_diff_data_files_names_each_file(tmp_path: Path) -> None:
    (tmp_path / "a").write_bytes(b"1")
    (tmp_path / "b").write_bytes(b"2")
    saved = fingerprint(data=tmp_path)
    (tmp_path / "b").write_bytes(b"22")
    (tmp_path / "a").unlink()
    (tmp_path / "c").write_bytes(b"3")
    got = {c.field: c for c in diff(saved, fingerprint(data=tmp_path))}
    assert set(got) == {"data.hash", f"data.files[{tmp_path / 'a'}]", f"data.files[{tmp_path / 'b'}]",
                        f"data.files[{tmp_path / 'c'}]"}
    assert all(c.severity == "significant" for c in got.values())
    assert got[f"data.files[{tmp_path / 'a'}]"].current is MISSING
    assert got[f"data.files[{tmp_path / 'c'}]"].saved is MISSING
    assert got[f"data.files[{tmp_path / 'b'}]"].current["size"] == 2


def test_diff_world_size(base: dict[str, Any]) -> None:
    assert changed(base, world_size=8) == [Change("world_size", base["world_size"], 8, "significant")]


def test_diff_host_platform_argv_are_info_and_rank_is_not_compared(base: dict[str, Any]) -> None:
    got = changed(base, host="node-17", platform="Linux-other", argv=["train.py", "--resume"], rank=3)
    assert [(c.field, c.severity) for c in got] == [("argv", "info"), ("host", "info"), ("platform", "info")]


def test_diff_top_level_key_not_recorded_is_info(base: dict[str, Any]) -> None:
    # a manifest written before "git"/"config"/"data" were recorded: nothing to compare
    old = {k: v for k, v in base.items() if k not in ("git", "config", "data", "packages")}
    got = diff(old, base)
    assert {c.field for c in got} == {"git", "config", "data", "packages"}
    assert all(c.severity == "info" and c.saved is MISSING for c in got)


# ------------------------------------------------------------------ format/check
def test_format_changes_is_readable_and_capped() -> None:
    text = format_changes([Change("host", "a", "b", "info"), Change("config.lr", 0.001, 0.002, "significant"),
                           Change("config.wd", MISSING, 0.1, "significant")])
    assert text.splitlines() == ["  config.lr: 0.001 -> 0.002", "  config.wd: (absent) -> 0.1",
                                 "  host: a -> b (info)"]
    many = [Change(f"config.k{i}", i, i + 1, "significant") for i in range(envmod.MAX_LINES + 5)]
    assert format_changes(many).splitlines()[-1] == "  ... and 5 more"
    assert "..." in str(Change("config.s", "x" * 500, "y", "significant"))


def records(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "unbroken"]


def test_check_ignore_is_silent(base: dict[str, Any], caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="unbroken")
    current = copy.deepcopy(base) | {"torch": "9.9.9"}
    assert check(base, current, policy="ignore") == []
    assert records(caplog) == []


def test_check_warn_logs_one_readable_warning(base: dict[str, Any], caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="unbroken")
    current = copy.deepcopy(base)
    current["config"]["lr"] = 0.002
    current["host"] = "node-17"
    got = check(base, current)  # "warn" is the default
    assert [c.field for c in got] == ["config.lr", "host"]
    (rec,) = records(caplog)
    assert rec.levelno == logging.WARNING
    assert "config.lr: 0.001 -> 0.002" in rec.getMessage()
    assert f"host: {base['host']} -> node-17 (info)" in rec.getMessage()


def test_check_warn_info_only_is_not_a_warning(base: dict[str, Any], caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="unbroken")
    assert len(check(base, copy.deepcopy(base) | {"host": "elsewhere"}, "warn")) == 1
    assert [r.levelno for r in records(caplog)] == [logging.INFO]


def test_check_nothing_changed_logs_nothing(base: dict[str, Any], caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="unbroken")
    assert check(base, copy.deepcopy(base), "strict") == []
    assert records(caplog) == []


def test_check_strict_raises_naming_every_significant_field(base: dict[str, Any]) -> None:
    current = copy.deepcopy(base)
    current["config"]["lr"] = 0.002
    current["git"]["commit"] = "b" * 40
    current["world_size"] = 8
    current["host"] = "node-17"
    with pytest.raises(EnvironmentMismatchError) as err:
        check(base, current, "strict")
    msg = str(err.value)
    for line in ("config.lr: 0.001 -> 0.002", f"git.commit: {'a' * 40} -> {'b' * 40}",
                 f"world_size: {base['world_size']} -> 8"):
        assert line in msg
    assert "host" not in msg
    assert "EnvCheck(policy='warn')" in msg and "restore that environment" in msg
    assert isinstance(err.value, UnbrokenError)


def test_check_strict_with_only_info_changes_does_not_raise(base: dict[str, Any]) -> None:
    current = copy.deepcopy(base) | {"host": "node-17", "argv": ["x"], "gpus": ["other"]}
    assert {c.severity for c in check(base, current, "strict")} == {"info"}


def test_check_strict_accepts_an_old_minimal_fingerprint(tmp_path: Path) -> None:
    current = fingerprint(config={"lr": 0.1}, data="d", cwd=tmp_path)
    old_keys = ("unbroken", "python", "torch", "numpy", "platform", "host", "argv", "world_size", "rank")
    old = {k: current[k] for k in old_keys}
    check(old, current, "strict")


def test_check_unknown_policy(base: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="unknown environment policy 'loud'"):
        check(base, base, "loud")
