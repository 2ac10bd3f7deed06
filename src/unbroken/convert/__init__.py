"""Converting checkpoints from and to other tools: ``unbroken import`` and ``unbroken export``.

- :func:`import_checkpoint` — an HF Trainer ``checkpoint-N/`` folder, a DeepSpeed ZeRO checkpoint
  folder (:mod:`.deepspeed`), a Lightning ``.ckpt`` or a ``torch.save`` file into a run, pickles
  loaded safely (:mod:`.pickles`).
- :func:`export_weights` — a checkpoint's model weights (or a DeepSpeed engine's) as safetensors or
  an HF model folder (never over a file it did not write without ``force``, never into a checkpoint
  or run).
- :mod:`.bounds` — how far an untrusted source may expand (shared references, declared sizes).
"""

from .exporting import export_weights
from .importing import Imported, import_checkpoint, read_source
from .pickles import UntrustedPickleError, load_pickle

__all__ = ["Imported", "UntrustedPickleError", "export_weights", "import_checkpoint", "load_pickle", "read_source"]
