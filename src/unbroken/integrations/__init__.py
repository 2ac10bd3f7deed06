"""Integrations with training frameworks, each an optional extra.

- :mod:`unbroken.integrations.hf` — the Hugging Face ``transformers.Trainer`` (``pip install 'unbroken[hf]'``).
- :mod:`unbroken.integrations.lightning` — PyTorch Lightning (``pip install 'unbroken[lightning]'``).
- :mod:`unbroken.integrations.accelerate` — Hugging Face Accelerate loops (``pip install 'unbroken[accelerate]'``).

They use only unbroken's public API. Importing one without its framework raises an
``ImportError`` that names the extra to install.
"""
