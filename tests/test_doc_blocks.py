"""Every Python block of the README and the docs runs (issue 36): a documented loop can never raise again.

Each block is listed in :data:`BLOCKS` by its page, the heading above it and its place under that heading,
and says how it runs:

- :class:`Run` — executed as written in a process of its own group (``tests/docrun.py``), after a prelude
  that defines what the page leaves to the reader (a tiny model, data, an optimizer...). Where a block
  writes ``...`` for the reader's own arguments or names a machine's resources (a GPU, ``/nvme``, an S3
  endpoint), ``subs`` replaces exactly those texts, declared here, and fails if one is no longer in the
  block. ``after`` checks what the block promised (the loop reached its last step, the value was restored).
  Loops cross epoch ends (the data is 3 batches, the loops run more).
- :class:`Excerpt` — the lines a "made exact" recipe adds or changes (``# +`` / ``# ~``) are the marked
  lines of the script a named test runs, killed and resumed (``tests/upstream/``): each doc line is there.
- :class:`Elsewhere` — run by the named test in the environment it needs and this file cannot give
  (LLaMA-Factory's and TRL's own environment, an imported DeepSpeed checkpoint); the test must exist.

A block not listed fails :func:`test_every_block_is_listed` (a new block must say how it runs), and so does
an entry whose block is gone.
"""

from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

import docblocks
import jobs

REPO = docblocks.REPO
PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
RUNNER = Path(__file__).with_name("docrun.py")
TORCHRUN = jobs.torchrun(1, RUNNER)[:-1]  # one rank: the blocks written for several processes, as a torchrun job


@dataclass(frozen=True)
class Run:
    group: str  # "plain" (one process), "torchrun" / "deepspeed" (a torchrun job of one rank), "s3" (a SeaweedFS)
    prelude: str = ""
    subs: tuple[tuple[str, str], ...] = ()
    after: str = ""


@dataclass(frozen=True)
class Excerpt:
    script: str  # tests/upstream/..., the script the test runs
    test: str


@dataclass(frozen=True)
class Elsewhere:
    test: str
    why: str


# ------------------------------------------------------------------------------------------ preludes
TORCH = '''
import argparse, torch, unbroken, unbroken.data
torch.manual_seed(0)
dataset = torch.utils.data.TensorDataset(torch.randn(96, 8), torch.randn(96, 1))   # 3 batches of 32
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
opt = optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
sched = scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
scaler = torch.amp.GradScaler("cpu")
loss_fn = torch.nn.functional.mse_loss
total_steps = 7                                     # more than two epochs
args = argparse.Namespace(lr=0.1, epochs=3)


def _exercise(ckpt):
    """What a constructor-only block is for: restore, train 3 steps that save, close."""
    state = {"model": model, "optimizer": opt}
    ckpt.restore(state)
    for _ in range(3):
        loss = model(torch.randn(4, 8)).pow(2).mean()
        loss.backward(); opt.step(); opt.zero_grad()
        ckpt.step(state, loss=loss)
    ckpt.save(state)
    ckpt.close()
'''
LOOP = TORCH + '''
loader = unbroken.data.ResumableLoader(dataset, batch_size=32, shuffle=True, seed=0)
ckpt = unbroken.Checkpointer("runs/exp1", save_every=2)
state = {"model": model, "optimizer": opt, "scheduler": sched, "data": loader}
ckpt.restore(state)


def train(*_):
    for x, y in loader:
        loss = loss_fn(model(x), y)
        loss.backward(); opt.step(); sched.step(); opt.zero_grad()
        ckpt.step(state, loss=loss)


def evaluate(*_):
    return 0.5


val_loader = None
'''
HF = TORCH + '''
import datasets, transformers
from transformers import GPT2Config, GPT2LMHeadModel

transformers.set_seed(0)
model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=1, n_head=2))


class _Tokens(torch.utils.data.Dataset):
    def __len__(self):
        return 24

    def __getitem__(self, i):
        ids = torch.arange(i, i + 16) % 64
        return {"input_ids": ids, "labels": ids}


train_ds, eval_ds = _Tokens(), _Tokens()
HF_ARGS = dict(max_steps=5, per_device_train_batch_size=4, report_to=[], use_cpu=True, disable_tqdm=True,
               logging_steps=100)
'''
LIGHTNING = TORCH + '''
import pytorch_lightning as pl
from pytorch_lightning import Trainer


class LitModel(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(8, 1)
        self.train_set = dataset

    def training_step(self, batch, _):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self):
        return unbroken.data.ResumableLoader(self.train_set, batch_size=32, shuffle=True, seed=0)


model = LitModel()
PL_ARGS = dict(max_steps=7, accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
               enable_checkpointing=False)
'''
ACCELERATE = HF + '''
from torch.utils.data import DataLoader
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + s))
train_set = _Tokens()
collate = torch.utils.data.default_collate
eval_loader = DataLoader(_Tokens(), batch_size=8)
max_steps = 7                                      # 24 samples, 16 a step (2 x 8 accumulated): epochs end


def evaluate(loader):
    for _ in loader:
        pass
'''
NANOGPT = TORCH + '''
data = torch.randint(0, 64, (1000,))


def get_batch(split):
    ix = torch.randint(len(data) - 9, (4,))
    return torch.stack([data[i:i + 8] for i in ix]), torch.stack([data[i + 1:i + 9] for i in ix])


class GPT(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(64, 64)

    def forward(self, X, Y):
        logits = self.emb(X)
        return logits, torch.nn.functional.cross_entropy(logits.view(-1, 64), Y.view(-1))


model = GPT()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
gradient_accumulation_steps, max_iters = 2, 9
'''
DATA = TORCH + '''
import types
import datasets
from datasets import Dataset

ds = Dataset.from_dict({"x": [[float(i)] * 8 for i in range(64)]})
web_ds, code_ds, math_ds = (torch.utils.data.TensorDataset(torch.full((40, 8), float(k))) for k in range(3))
tokenized = [{"input_ids": list(range(1, 2 + (37 * i) % 700))} for i in range(64)]   # 22k tokens
tokenizer = types.SimpleNamespace(eos_token_id=0)
rank, world = 0, 1
STREAM_FILES = [f"stream-{k}.jsonl" for k in range(4)]   # 4 shards: one for each of the block's 4 workers
for k, name in enumerate(STREAM_FILES):
    with open(name, "w") as f:
        f.writelines(f'{{"text": "{i}"}}\\n' for i in range(k, 100, 4))


def tokenize(ex):
    return {"input_ids": [int(ex["text"]) % 64] * 4}


def collator(rows):
    return torch.tensor([r["input_ids"] for r in rows])
'''

LOOP_DONE = "assert ckpt.progress.step == total_steps, ckpt.progress.step"
DEEPSPEED = Elsewhere("tests/test_deepspeed.py::test_the_documented_loop_runs_across_epoch_ends_and_resumes",
                      "needs DeepSpeed under torchrun; that test extracts this block from the page and runs it")
UPSTREAM = "tests/test_upstream_loops.py::test_killed_everywhere_around_the_epoch_boundary_resumes_bitwise"

# ------------------------------------------------------------------------------------------ the blocks
BLOCKS: dict[tuple[str, str, int], Run | Excerpt | Elsewhere] = {
    ("README.md", "With the HF Trainer, LLaMA-Factory, TRL, Lightning or Accelerate: one line", 0): Run(
        "plain", HF + "from pytorch_lightning import Trainer\nimport accelerate, lightning_fabric\n"
        "hf_trainer = trainer = transformers.Trainer(model=model, train_dataset=train_ds,\n"
        "    args=transformers.TrainingArguments(output_dir='out', save_strategy='no', **HF_ARGS))\n"
        "accelerator = accelerate.Accelerator()\n"
        "_m, _o = accelerator.prepare(torch.nn.Linear(8, 1), None)\n",
        subs=(("run_exp(callbacks=", "_lf = dict(callbacks="),  # LLaMA-Factory's run_exp: tests/test_llamafactory.py
              ("Trainer(..., callbacks", "Trainer(max_steps=2, accelerator='cpu', logger=False, callbacks")),
        after="ckpt.close()  # the three integrations share one run folder here: one at a time\n"
              "hf_trainer.train()\nassert hf_trainer.state.global_step == 5"),
    ("README.md", "Add it to your loop", 0): Run("plain", TORCH, after=LOOP_DONE),
    ("README.md", "Several ranks and nodes", 0): Run(
        "torchrun", TORCH, subs=(('"/shared/runs/exp1"', '"shared/runs/exp1"'),), after="_exercise(ckpt)"),
    ("data.md", "Hugging Face map-style `Dataset`", 0): Run(
        "plain", DATA, after="assert torch.is_tensor(ds[0]['x'][0])"),
    ("data.md", "Hugging Face map-style `Dataset`", 1): Run(
        "plain", DATA + "ds.set_format('torch')\n", after="assert len(list(loader)) == 2"),
    ("data.md", "Hugging Face streaming `IterableDataset`: `StreamLoader`", 0): Run(
        "plain", DATA, subs=(('load_dataset("...",', 'load_dataset("json", data_files=STREAM_FILES,'),),
        after="assert sum(len(b) for b in loader) == 100"),
    ("data.md", "Weighted mixtures and curricula: `Mixture`", 0): Run(
        "plain", DATA, after="assert len(next(iter(loader))[0]) == 32"),
    ("data.md", "Packing and bucketing collators: `CarryOver`", 0): Run(
        "plain", DATA, after="ids, pos = batch['input_ids'], batch['position_ids']\n"
                             "assert ids.shape[1] == 2048 and pos.shape == ids.shape"),
    ("distributed.md", "Several processes: torchrun, SLURM, DDP, FSDP2, DeepSpeed, and a different world size", 0): Run(
        "torchrun", TORCH + "build_model = lambda: torch.nn.Linear(8, 1)\nloss = torch.tensor(1.0)\n",
        subs=(('init_distributed("nccl")', 'init_distributed("gloo")'), (".cuda()", ""),
              ('"/shared/runs/exp1"', '"shared/runs/exp1"')),
        after="assert ckpt.progress.step == 3"),
    ("distributed.md", "In short", 0): Run(
        "torchrun", TORCH, subs=(('"/shared/runs/exp1"', '"shared/runs/exp1"'),), after="_exercise(ckpt)"),
    ("faults.md", "A RAM tier: save every step, resume from memory", 0): Run("plain", TORCH, after="_exercise(ckpt)"),
    ("faults.md", "Recovery without relaunch", 0): Run(
        "plain", TORCH + "loader = unbroken.data.ResumableLoader(dataset, batch_size=32, shuffle=True, seed=0)\n",
        after="assert ckpt.progress.step == 3"),
    ("index.md", "unbroken", 0): Run("plain", TORCH, after=LOOP_DONE),
    ("integrations.md", "Hugging Face `transformers.Trainer`", 0): Run(
        "plain", HF, subs=(("TrainingArguments(...,", "TrainingArguments(**HF_ARGS,"),),
        after="assert trainer.state.global_step == 5"),
    ("integrations.md", "Several ranks: DDP, FSDP, DeepSpeed", 0): Run(
        "deepspeed", HF, subs=(("TrainingArguments(...,", "TrainingArguments(**HF_ARGS,"),
                               ('"/shared/runs/exp1"', '"shared/runs/exp1"')),
        after="assert trainer.state.global_step == 5 and type(trainer.model_wrapped).__name__ == 'DeepSpeedEngine'"),
    ("integrations.md", "LLaMA-Factory, TRL and other Trainers built for you", 0): Elsewhere(
        "tests/test_llamafactory.py::test_llamafactory_sigkilled_twice_and_sigtermed_resumes_bitwise",
        "LLaMA-Factory runs in its own environment, which that test builds; its train.py is this block"),
    ("integrations.md", "LLaMA-Factory, TRL and other Trainers built for you", 1): Elsewhere(
        "tests/test_llamafactory.py::test_trl_sfttrainer_sigkilled_resumes_bitwise",
        "TRL is installed in LLaMA-Factory's environment; tests/lf_builtelsewhere.py builds this SFTTrainer"),
    ("integrations.md", "PyTorch Lightning", 0): Run(
        "plain", LIGHTNING, subs=(("Trainer(...,", "Trainer(**PL_ARGS,"),), after="assert trainer.global_step == 7"),
    ("integrations.md", "PyTorch Lightning", 1): Run(
        "plain", LIGHTNING, after="assert len(list(train_dataloader(model))) == 3"),
    ("integrations.md", "`UnbrokenCheckpointIO`: Lightning's own checkpoint files through unbroken", 0): Run(
        "plain", LIGHTNING + "from unbroken.integrations.lightning import UnbrokenCheckpointIO\n",
        subs=(("Trainer(...,", "Trainer(**dict(PL_ARGS, enable_checkpointing=True, default_root_dir='root'),"),),
        after="trainer.fit(model)\nassert trainer.global_step == 7"),
    ("integrations.md", "Several ranks: DDP, FSDP, DeepSpeed", 1): Run(
        "plain", LIGHTNING + "from unbroken.integrations.lightning import UnbrokenCallback\n",
        subs=(('accelerator="gpu", devices=8,', 'accelerator="cpu", devices=1, max_steps=7,'),
              ('"/shared/runs/exp1"', '"shared/runs/exp1"')),
        after="assert trainer.global_step == 7"),
    ("integrations.md", "Accelerate", 0): Run("torchrun", ACCELERATE, after="assert ckpt.progress.step == max_steps"),
    ("integrations.md", "DeepSpeed ZeRO (stages 1, 2 and 3)", 0): DEEPSPEED,
    ("integrations.md", "DeepSpeed's own checkpoints in, weights out", 0): Elsewhere(
        "tests/test_deepspeed_convert.py::test_an_imported_deepspeed_checkpoint_resumes_on_any_world_size",
        "needs a DeepSpeed checkpoint imported by `unbroken import`; tests/ds_train.py restores it this way"),
    ("saving.md", "When to save, what to keep", 0): Run(
        "plain", TORCH + "state = {'model': model, 'optimizer': opt}\nval_loss = 0.5\n",
        after="assert {t for c in ckpt.checkpoints() for t in c.tags} == {'v1-before-lr-drop', 'paper-result'}"),
    ("saving.md", '`save_every="auto"`: the interval from what saves cost and how often the run fails', 0): Run(
        "plain", TORCH, after="_exercise(ckpt)"),
    ("saving.md", "Saving in the background", 0): Run("plain", TORCH, after="_exercise(ckpt)"),
    ("saving.md", "Lazy snapshots: the loop does not even wait for the copy", 0): Run(
        "plain", TORCH, after="_exercise(ckpt)"),
    ("saving.md", "Incremental checkpoints: a frozen base is written once", 0): Run(
        "plain", TORCH, after="_exercise(ckpt)"),
    ("storage.md", "Where checkpoints live: a folder, S3, or both", 0): Run(
        "s3", TORCH, subs=(("my-bucket/exp1", "{bucket}/exp1"), ("https://minio.internal:9000", "{endpoint}"),
                           ('"/nvme/exp1"', '"nvme/exp1"')),
        after="_exercise(ckpt)"),
    ("storage.md", "The run index", 0): Run(
        "plain", TORCH + "_exercise(unbroken.Checkpointer('runs/exp1', save_every=1))\n",
        after="assert idx.metric('loss')"),
    ("your-loop.md", "Epoch loops: evaluation and `scheduler.step()` at the end of each epoch", 0): Run(
        "plain", LOOP, after="assert ckpt.progress.epoch == 3 and ckpt.progress.step == 9"),
    ("your-loop.md", "Plain variables the loop changes: `unbroken.Vars`", 0): Run(
        "plain", LOOP, after="assert loop.lr == args.lr / 4"),
    ("your-loop.md", "Plain variables: `unbroken.Vars`", 0): Run("plain", LOOP, after="assert state['lr'] == 0.1"),
    ("your-loop.md", "Plain variables: `unbroken.Vars`", 1): Run(
        "plain", LOOP, after="assert loop.lr == args.lr and loop.hidden is None"),
    ("your-loop.md", "Batches drawn by the loop, the next one fetched ahead (nanoGPT)", 0): Run(
        "plain", NANOGPT, after="assert ckpt.progress.step == 10 and fetched.X is not None"),
    ("your-loop.md", "PyTorch's `mnist`, made exact", 0): Excerpt("tests/upstream/mnist_main.py", UPSTREAM),
    ("your-loop.md", "PyTorch's `word_language_model`, made exact", 0): Excerpt("tests/upstream/wlm_main.py", UPSTREAM),
}


@functools.cache
def _blocks() -> dict[tuple[str, str, int], str]:  # read once per session, not once per block
    found: dict[tuple[str, str, int], str] = {}
    for page in PAGES:
        seen: dict[str, int] = {}
        for heading, code in docblocks.python_blocks(page):
            n = seen[heading] = seen.get(heading, -1) + 1
            name = str(page.relative_to(REPO / "docs")) if page.parent.name == "docs" else page.name
            found[(name, heading, n)] = code
    return found


def test_every_block_is_listed() -> None:
    found = set(_blocks())
    assert not found - set(BLOCKS), f"blocks that say nowhere how they run: {sorted(found - set(BLOCKS))}"
    assert not set(BLOCKS) - found, f"entries whose block is gone: {sorted(set(BLOCKS) - found)}"


def _source(key: tuple[str, str, int], entry: Run, fill: dict[str, str]) -> str:
    code = _blocks()[key]
    for old, new in entry.subs:
        assert old in code, f"{key}: the substitution {old!r} is no longer in the block"
        code = code.replace(old, new.format(**fill))
    return f"{entry.prelude}\n# ---- the block, as the page shows it\n{code}\n# ---- after\n{entry.after}\n"


def _run_group(keys: list, prefix: list[str], env: dict[str, str], tmp: Path, fill: dict[str, str]) -> None:
    spec = [{"id": f"{k[0]} | {k[1]} | {k[2]}", "code": _source(k, BLOCKS[k], fill), "cwd": str(tmp / f"b{i}")}
            for i, k in enumerate(keys)]
    (tmp / "spec.json").write_text(json.dumps(spec))
    p = subprocess.run([*prefix, str(RUNNER), str(tmp / "spec.json"), str(tmp / "results.json")], env=env, cwd=tmp,
                       capture_output=True, text=True, timeout=900)
    results = json.loads((tmp / "results.json").read_text()) if (tmp / "results.json").exists() else []
    failed = {r["id"]: r["error"] for r in results if not r["ok"]}
    report = "".join(f"\n==== {block} ====\n{error}" for block, error in failed.items())
    assert not failed, f"{len(failed)} of {len(spec)} blocks raised:{report}"
    assert p.returncode == 0 and len(results) == len(spec), \
        f"exit {p.returncode}, {len(results)} of {len(spec)} blocks ran\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"


def _env(tmp: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("UNBROKEN_", "MASTER_", "RANK", "WORLD_SIZE"))}
    return dict(env, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", UNBROKEN_RAM_ROOT=str(tmp / "shm"),
                TRANSFORMERS_VERBOSITY="error", PYTHONWARNINGS="ignore", **extra)


def _keys(group: str) -> list:
    return [k for k, v in BLOCKS.items() if isinstance(v, Run) and v.group == group]


@pytest.mark.e2e
@pytest.mark.slow  # one process, but it imports transformers, Lightning, datasets and Accelerate: 40-50 s
def test_the_plain_blocks_run(tmp_path: Path) -> None:
    _run_group(_keys("plain"), [sys.executable], _env(tmp_path), tmp_path, {})


@pytest.mark.e2e
@pytest.mark.slow
def test_the_blocks_of_several_processes_run_under_torchrun(tmp_path: Path) -> None:
    """One job for all of them: ``unbroken.init_distributed()`` is a no-op once the group exists."""
    _run_group(_keys("torchrun"), TORCHRUN, _env(tmp_path), tmp_path, {})


@pytest.mark.e2e
@pytest.mark.slow
def test_the_deepspeed_blocks_run_under_torchrun(deepspeed_env: dict[str, str], tmp_path: Path) -> None:
    env = _env(tmp_path, DS_ACCELERATOR="cpu", TORCH_EXTENSIONS_DIR=deepspeed_env["TORCH_EXTENSIONS_DIR"])
    _run_group(_keys("deepspeed"), TORCHRUN, env, tmp_path, {})


@pytest.mark.e2e
def test_the_s3_blocks_run(s3, tmp_path: Path) -> None:
    _run_group(_keys("s3"), [sys.executable], _env(tmp_path, **s3.env), tmp_path,
               {"bucket": s3.new_bucket(), "endpoint": s3.endpoint})


_MARKED = re.compile(r"#\s*[+~]")


def _code(line: str) -> str:
    return re.sub(r"\s+", " ", line.split("#")[0]).strip()


@pytest.mark.parametrize("key", [k for k, v in BLOCKS.items() if isinstance(v, Excerpt)], ids=lambda k: k[1])
def test_an_excerpt_is_the_marked_lines_of_the_script_its_test_runs(key) -> None:
    entry = BLOCKS[key]
    assert isinstance(entry, Excerpt)
    script = (REPO / entry.script).read_text()
    marked = {_code(x) for x in script.splitlines() if "# +unbroken" in x or "# ~unbroken" in x}
    doc = [_code(x) for x in _blocks()[key].splitlines() if _MARKED.search(x) and _code(x) not in ("", "...")]
    assert doc, key
    missing = [x for x in doc if x not in marked]
    assert not missing, f"lines of the docs' recipe that {entry.script} does not have (marked): {missing}"
    _test_exists(entry.test)


def _test_exists(test: str) -> None:
    path, name = test.split("::")
    assert re.search(rf"^def {re.escape(name)}\(", (REPO / path).read_text(), re.M), f"{test} does not exist"


@pytest.mark.parametrize("key", [k for k, v in BLOCKS.items() if isinstance(v, Elsewhere)], ids=lambda k: k[1])
def test_a_block_run_elsewhere_names_a_test_that_exists(key) -> None:
    entry = BLOCKS[key]
    assert isinstance(entry, Elsewhere) and entry.why
    _test_exists(entry.test)
