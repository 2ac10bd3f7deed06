"""Warm restarts: a training process restarted after a failure by a spare interpreter that has imported torch.

``unbroken run -- python train.py`` (:mod:`.supervisor`) restarts one training process:

- :mod:`.command`: which commands a spare can become (``python [flags] script`` or ``-m module``);
- :mod:`.spare`: the waiting interpreter;
- :mod:`.supervisor`: the restart loop, the signals, the exit status;
- under torchrun (``torchrun ... -m unbroken.launch.worker train.py``): :mod:`.worker` (the process torchrun
  starts and watches, which hands its launch to a spare), :mod:`.server` (the node's spares), :mod:`.forker`
  (the one interpreter that imports torch and forks the spares; its owner's side :mod:`.forks`) and :mod:`.wire`
  (their socket, its checks and messages).
"""
