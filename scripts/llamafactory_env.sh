#!/bin/sh
# Build the LLaMA-Factory test environment: a virtual environment at $1 holding llamafactory 0.9.5
# and what its SFT path imports, with the CPU build of torch 2.13.0 (constraints.txt).
#
#   sh scripts/llamafactory_env.sh DIR          # PYTHON=python3.11 to pick the interpreter (>= 3.11)
#
# Why its own environment: llamafactory 0.9.5 pins transformers<=5.6, accelerate<=1.11,
# peft<=0.18.1, trl<=0.24, datasets<=4.0, while the project's environment has transformers 5.24.
# llamafactory is installed without its dependencies (gradio, fastapi, modelscope, av, ... serve
# the web UI, the API and multimodal data), then the ones the SFT path imports, at the highest
# versions llamafactory accepts. Not installed: torchaudio and torchvision. PyPI's newest
# torchaudio (2.11.0) is a CUDA build (its library needs libc10_cuda.so) and there is none for
# torch 2.13; the job (tests/lf_sft.py) puts a stand-in module in its place (LLaMA-Factory imports
# it at module level, for audio inputs only). torchvision is not imported on this path.
# unbroken itself is not installed: the tests put the work tree's src/ on PYTHONPATH.
set -eu
DIR=${1:?usage: llamafactory_env.sh DIR}
HERE=$(cd "$(dirname "$0")/.." && pwd)
PYTHON=${PYTHON:-python3}

"$PYTHON" -m venv "$DIR"
# torch through pip (it takes this machine's own file of the CPU build), the rest through uv (the same
# versions from the same constraints, in seconds instead of a minute; bytecode compiled as pip does)
"$DIR/bin/python" -m pip install -q --disable-pip-version-check -c "$HERE/constraints.txt" torch==2.13.0 uv==0.13.9
pip() { "$DIR/bin/uv" pip install -q --compile-bytecode --python "$DIR/bin/python" -c "$HERE/constraints.txt" "$@"; }
pip transformers==5.6.0 accelerate==1.11.0 peft==0.18.1 trl==0.24.0 datasets==4.0.0 omegaconf \
    numpy safetensors xxhash fsspec rich typer
pip --no-deps llamafactory==0.9.5
"$DIR/bin/python" -c "import llamafactory, transformers, trl, peft; print('llamafactory', llamafactory.__version__, \
'transformers', transformers.__version__, 'trl', trl.__version__, 'peft', peft.__version__)"
