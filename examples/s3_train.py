"""Checkpoints in S3 (or any S3-compatible server), optionally behind a fast local tier.

    pip install -e '.[s3]'
    export AWS_ACCESS_KEY_ID=... AWS_SECRET_ACCESS_KEY=...     # the usual boto variables / profile
    python examples/s3_train.py --run s3://my-bucket/exp1 --endpoint-url http://127.0.0.1:9000 --steps 100

    # tiered: every save commits to a local folder, a background thread uploads it to S3
    python examples/s3_train.py --run s3://my-bucket/exp1 --local /nvme/exp1 --steps 100

Only the run location changes: ``Checkpointer("s3://bucket/exp1", storage_options=...)``.
``storage_options`` go to s3fs unchanged (``endpoint_url``, ``key``, ``secret``,
``profile``...); without them the AWS_* variables and config files are used
(``AWS_ENDPOINT_URL`` too). A checkpoint commits when its ``manifest.json`` is written,
after every data object, so a job killed mid-upload leaves nothing that looks like a
checkpoint, and the next run resumes from the newest one that verifies.

With ``--local``, the loop waits only for the local save; the upload runs in the
background with its own retention (``keep_last`` locally, ``Remote(keep_last=...)``
remotely), and a restore picks the newest valid checkpoint in either tier: on a fresh
machine (an empty ``--local``) it is downloaded from S3. ``close()`` waits for the uploads.

The last line, ``final ... sha256 ...``, fingerprints the parameters and optimizer state.
The learning-rate schedule does not depend on ``--steps``, so a run can be extended:
``--steps 20`` then ``--steps 40`` ends like one run of 40 steps.
"""

from __future__ import annotations

import argparse
import hashlib
import sys

import torch

import unbroken


def fingerprint(model: torch.nn.Module, opt: torch.optim.Optimizer) -> str:
    h = hashlib.sha256()
    for t in model.state_dict().values():
        h.update(t.detach().contiguous().numpy().tobytes())
    for _, st in sorted(opt.state_dict()["state"].items()):
        for _, t in sorted(st.items()):
            h.update(t.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--run", required=True, help="s3://bucket/prefix (or any fsspec URL or folder)")
    p.add_argument("--endpoint-url", default=None,
                   help="an S3-compatible server (MinIO, SeaweedFS, Ceph...); without it, s3fs's own "
                        "configuration: $AWS_ENDPOINT_URL, ~/.aws/config, else AWS itself")
    p.add_argument("--local", default=None, help="a fast local folder to save to first (tiered mode)")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--save-every", type=int, default=10)
    args = p.parse_args(argv)
    storage_options = {"endpoint_url": args.endpoint_url} if args.endpoint_url else None

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.ReLU(), torch.nn.Dropout(0.1),
                                torch.nn.Linear(128, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.99)
    data = torch.Generator().manual_seed(1)  # the batches: a generator in the state resumes exactly
    w_true = torch.randn(32, 1, generator=torch.Generator().manual_seed(2))

    if args.local:  # tiered: save to the local folder, upload to S3 in the background
        ckpt = unbroken.Checkpointer(args.local, save_every=args.save_every, keep_last=2,
                                     remote=unbroken.Remote(args.run, keep_last=5, storage_options=storage_options))
    else:           # straight to S3: each save commits there before the loop goes on
        ckpt = unbroken.Checkpointer(args.run, save_every=args.save_every, keep_last=3,
                                     storage_options=storage_options)
    state = {"model": model, "optimizer": opt, "scheduler": sched, "data_rng": data}
    info = ckpt.restore(state)  # tiered: the newest valid checkpoint of either tier, downloaded if only in S3
    print(f"resumed from step {info.step}" if info else "fresh start", flush=True)

    while ckpt.progress.step < args.steps:
        x = torch.randn(64, 32, generator=data)
        y = x @ w_true + 0.1 * torch.randn(64, 1, generator=data)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad()
        ckpt.step(state, loss=loss)
        print(f"step {ckpt.progress.step} loss {loss.item()!r}", flush=True)

    ckpt.wait()  # tiered: until every checkpoint is uploaded (close() waits too, up to a timeout)
    newest = ckpt.latest()
    if newest is not None:
        print(f"newest checkpoint {newest.name} in {' and '.join(newest.tiers) or args.run}", flush=True)
    ckpt.close()
    print(f"final step {ckpt.progress.step} sha256 {fingerprint(model, opt)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
