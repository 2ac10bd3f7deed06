"""``unbroken import`` of DeepSpeed's own checkpoints and ``unbroken export`` of DeepSpeed runs (issue 24).

Real components: tests/ds_train.py under torchrun (CPU, gloo), 2 ranks, ZeRO-2 and ZeRO-3, writes
DeepSpeed's checkpoint with ``engine.save_checkpoint`` after step K (``--ds-save-at``) and dumps the
consolidated fp32 masters and Adam moments there (DeepSpeed's ``safe_get_full_*``). The folder is
imported with the CLI and resumed by ds_train.py on 1 and on 2 ranks: the restored state must be
bitwise the dumped one. The export test writes an HF folder from a ZeRO-3 run and compares it with
the full weights, the frozen parameter and the buffer the job gathered itself.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import unbroken
from unbroken.convert import UntrustedPickleError, import_checkpoint, read_source

assert importlib.util.find_spec("deepspeed"), "DeepSpeed is missing: `make test` installs it (the test extra)"
import jobs  # noqa: E402 - the local test modules come after the DeepSpeed check
from test_deepspeed import launch, same_tensors  # noqa: E402

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
SCRIPT = str(Path(__file__).parent / "ds_train.py")
K = 6
CLI = str(Path(sys.executable).parent / "unbroken")


@pytest.fixture(scope="module")
def env(deepspeed_env: dict[str, str]) -> dict[str, str]:
    return deepspeed_env


def torchrun(n: int, run: Path, out: Path, stage: int, *extra: str) -> list[str]:
    return jobs.torchrun(n, SCRIPT, "--run-dir", str(run), "--out", str(out), "--stage", str(stage), "--steps",
                           str(K), "--save-every", "3", "--buffer", *extra)


_trained: dict[int, Path] = {}


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory, env: dict[str, str]):
    """A 2-rank run of a stage for K steps: unbroken's run (``run/``), DeepSpeed's checkpoint of step K
    (``out/ds``), the consolidated state at step K (``out/state-K.safetensors``) and at the end, with the
    frozen parameter and the buffer (``out/final.safetensors``)."""
    def get(stage: int) -> Path:
        if stage not in _trained:
            base = tmp_path_factory.mktemp(f"ds-trained-{stage}")
            code, out = launch(torchrun(2, base / "run", base / "out", stage, "--dump-at", str(K), "--ds-save-at",
                                        str(K)), env, base)
            assert code == 0, out
            assert (base / "out" / "ds" / "latest").read_text().strip() == f"global_step{K}"
            _trained[stage] = base
        return _trained[stage]

    return get


def assert_same(a, b, path: str = "") -> None:
    """``a`` and ``b`` are the same tree: keys, types, values, tensors bitwise with dtype and shape."""
    assert type(a) is type(b), path
    if isinstance(a, dict):
        assert sorted(a) == sorted(b), path
        for k in a:
            assert_same(a[k], b[k], f"{path}/{k}")
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), path
    else:
        assert a == b, path


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([CLI, *args], capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_deepspeed_checkpoint_imports_masters_and_moments_bitwise(stage, trained, tmp_path) -> None:
    base = trained(stage)
    res = cli("import", str(base / "out" / "ds"), str(tmp_path / "run"), "--json")
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    assert doc["kind"] == "deepspeed" and doc["step"] == K and doc["parts"] == ["engine"]
    assert any("data position" in note for note in doc["left_out"])
    info = unbroken.verify(doc["checkpoint"])
    assert info.step == K and info.progress["samples"] == K * 16
    engine = unbroken.load(tmp_path / "run")["engine"]
    want = load_file(base / "out" / f"state-{K}.safetensors")
    assert engine["mode"] == ("zero3" if stage == 3 else "hp") and engine["stage"] == stage
    assert engine["world_size"] == 2
    assert engine["counters"]["global_steps"] == K and engine["counters"]["global_samples"] == K * 16
    assert sorted(engine["optimizer_state"]) == ["exp_avg", "exp_avg_sq"]
    trainable = sorted(k.split("/", 1)[1] for k in want if k.startswith("fp32/"))
    assert sorted(engine["master"]) == trainable and sorted(engine["frozen"]) == ["0.bias"]
    for name in trainable:  # every element of every rank's partition, put back in place
        assert torch.equal(engine["master"][name], want[f"fp32/{name}"].reshape(-1)), name
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(engine["optimizer_state"][key][name], want[f"{key}/{name}"].reshape(-1)), (key, name)
    assert [g["hyper"]["lr"] for g in engine["groups"]] == want["lr"].tolist()
    assert all(float(g["scalars"]["step"]) == K for g in engine["groups"])
    assert engine["scheduler"]["last_epoch"] == K
    # exactly what unbroken's own save of the same engine at the same step holds (every rank's pieces assembled)
    assert_same(engine, unbroken.load(base / "run" / f"step-{K:09d}")["engine"])
    # the same folder given by its tag folder imports the same
    again = read_source(base / "out" / "ds" / f"global_step{K}")
    assert torch.equal(again.state["engine"]["master"]["3.weight"], engine["master"]["3.weight"])


@pytest.mark.parametrize("stage,world", [(2, 1), (2, 2), (3, 1), (3, 2)])
def test_an_imported_deepspeed_checkpoint_resumes_on_any_world_size(stage, world, trained, env, tmp_path) -> None:
    """DeepSpeed's 2-rank checkpoint, imported, restored by a DeepSpeed job of 1 or 2 ranks through
    ``state = {"engine": engine, "data": loader}`` and ``restore(strict=False)``: the fp32 masters and
    Adam moments the engine holds then are bitwise those of the uninterrupted run at step K."""
    base = trained(stage)
    res = cli("import", str(base / "out" / "ds"), str(tmp_path / "run"))
    assert res.returncode == 0 and "imported deepspeed checkpoint" in res.stdout, res.stderr
    code, out = launch(torchrun(world, tmp_path / "run", tmp_path / "out", stage, "--dump-restored",
                                "--restore-nonstrict"), env, tmp_path)
    assert code == 0 and f"resumed from step {K}" in out, out
    assert not same_tensors(base / "out" / f"state-{K}.safetensors", tmp_path / "out" / "restored.safetensors")


def test_export_hf_of_a_zero3_run_gives_the_full_weights(trained, tmp_path) -> None:
    """A ZeRO-3 run (each rank saved its pieces) exported as an HF folder: the module's state_dict keys,
    each trainable weight bitwise DeepSpeed's ``safe_get_full_fp32_param``, the frozen parameter and the
    buffer as the module holds them. The default key finds the engine; an imported DeepSpeed checkpoint
    exports the same weights."""
    base = trained(3)
    (tmp_path / "config.json").write_text('{"model_type": "tiny"}')
    res = cli("export", str(base / "run"), "--to", str(tmp_path / "hf"), "--format", "hf", "--config",
              str(tmp_path / "config.json"))
    assert res.returncode == 0, res.stderr
    got = load_file(tmp_path / "hf" / "model.safetensors")
    final = load_file(base / "out" / "final.safetensors")
    want = {k.split("/", 1)[1]: v for k, v in final.items() if k.split("/", 1)[0] in ("fp32", "frozen", "buffer")}
    assert sorted(got) == sorted(want) == ["0.bias", "0.weight", "3.bias", "3.weight", "5.bias", "5.calibration",
                                           "5.weight"]
    for name, t in want.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name], t), name
    assert json.loads((tmp_path / "hf" / "config.json").read_text()) == {"model_type": "tiny"}
    # an explicit key, and a wrong one
    res = cli("export", str(base / "run"), "--to", str(tmp_path / "w.safetensors"), "--key", "engine")
    assert res.returncode == 0 and not same_tensors(tmp_path / "w.safetensors", tmp_path / "hf" / "model.safetensors")
    res = cli("export", str(base / "run"), "--to", str(tmp_path / "x.safetensors"), "--key", "model")
    assert res.returncode == 1 and "no part 'model'" in res.stderr and "engine" in res.stderr
    # DeepSpeed's own checkpoint of the same step, imported, exports the same weights
    import_checkpoint(base / "out" / "ds", tmp_path / "imported")
    res = cli("export", str(tmp_path / "imported"), "--to", str(tmp_path / "i.safetensors"))
    assert res.returncode == 0, res.stderr
    assert not same_tensors(tmp_path / "i.safetensors", tmp_path / "hf" / "model.safetensors")


def _copy(trained, stage: int, tmp_path: Path) -> Path:
    shutil.copytree(trained(stage) / "out" / "ds", tmp_path / "ds")
    return tmp_path / "ds"


def test_an_incomplete_deepspeed_folder_is_refused_clearly(trained, tmp_path) -> None:
    ds = _copy(trained, 3, tmp_path)
    tag = ds / f"global_step{K}"
    (ds / "latest").write_text("global_step99")
    with pytest.raises(unbroken.errors.UnbrokenError, match="names the tag 'global_step99'.*does not exist"):
        import_checkpoint(ds, tmp_path / "run")
    (ds / "latest").write_text("../../etc")
    with pytest.raises(unbroken.errors.UnbrokenError, match="not a tag folder name"):
        read_source(ds)
    (ds / "latest").write_text(f"global_step{K}")
    (tag / "zero_pp_rank_1_mp_rank_00_model_states.pt").unlink()
    with pytest.raises(unbroken.errors.UnbrokenError, match="lacks zero_pp_rank_1_mp_rank_00_model_states.pt"):
        read_source(ds)
    (tag / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    res = cli("import", str(ds), str(tmp_path / "run"))
    assert res.returncode == 1 and "written by 2 ranks" in res.stderr and "Traceback" not in res.stderr
    (tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt").rename(tag / "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    with pytest.raises(unbroken.errors.UnbrokenError, match="lacks the optimizer file of rank 0"):
        read_source(ds)
    assert not (tmp_path / "run").exists()


_EVIL = """
import os, sys, torch
class Evil:
    def __reduce__(self):
        return (os.system, ("touch " + sys.argv[2],))
torch.save({"optimizer_state_dict": {"zero_stage": 2, "partition_count": 2, "x": Evil()}}, sys.argv[1])
"""


def test_a_hostile_pickle_in_a_deepspeed_folder_runs_nothing(trained, tmp_path) -> None:
    ds = _copy(trained, 2, tmp_path)
    victim = ds / f"global_step{K}" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    marker = tmp_path / "pwned"
    subprocess.run([sys.executable, "-c", _EVIL, str(victim), str(marker)], check=True, timeout=120)
    with pytest.raises(UntrustedPickleError, match="system.*--trust-pickle"):
        read_source(ds)
    res = cli("import", str(ds), str(tmp_path / "run"))
    assert res.returncode == 1 and "UntrustedPickleError" in res.stderr and "Traceback" not in res.stderr
    assert not marker.exists() and not (tmp_path / "run").exists()
