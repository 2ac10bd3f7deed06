"""Integrations with training frameworks, each an optional extra.

- :mod:`unbroken.integrations.hf` — the Hugging Face ``transformers.Trainer`` (``pip install -e '.[hf]'``).
- :mod:`unbroken.integrations.lightning` — PyTorch Lightning (``pip install -e '.[lightning]'``).
- :mod:`unbroken.integrations.accelerate` — Hugging Face Accelerate loops (``pip install -e '.[accelerate]'``).

They use only unbroken's public API. Importing one without its framework raises an
``ImportError`` that names the extra to install.
"""
