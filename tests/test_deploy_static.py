"""Static checks of the Docker Compose demo in deploy/ (no Docker engine here or in CI): the files parse, images
pin the installed flwr, every Flower flag is one the installed binaries accept (`<binary> --help`), the certs
service calls deploy.certs correctly, GPUs go to SuperNodes only, and no weights, data or keys enter an image's
project copy."""

from __future__ import annotations

import functools
import importlib.metadata
import os
import re
import shlex
import subprocess
import sys
from fnmatch import fnmatch
from pathlib import Path, PurePosixPath

import pytest

yaml = pytest.importorskip("yaml", reason="PyYAML (a dependency of flwr) is needed to parse the compose files")

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
COMPOSE = DEPLOY / "docker-compose.yml"
GPU_OVERRIDE = DEPLOY / "docker-compose.gpu.yml"
DOCKERFILES = sorted((DEPLOY / "docker").glob("Dockerfile*"))
FLWR_VERSION = importlib.metadata.version("flwr")
CERTS_MOUNT = "/app/certs"
HELP_ENV = {**os.environ, "FLWR_TELEMETRY_ENABLED": "0", "FLWR_DISABLE_UPDATE_CHECK": "1"}  # --help stays offline


@functools.cache
def load(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def services(path: Path = COMPOSE) -> dict[str, dict]:
    return load(path)["services"]


def argv(service: dict) -> list[str]:
    """The container's command line: entrypoint + command, as compose passes them."""

    def as_list(value) -> list[str]:
        return shlex.split(value) if isinstance(value, str) else [str(v) for v in value or []]

    return as_list(service.get("entrypoint")) + as_list(service.get("command"))


def long_options(args: list[str]) -> list[tuple[str, str | None]]:
    """(--option, the token after it or its =value) for every long option."""
    found = []
    for i, token in enumerate(args):
        if token.startswith("--"):
            name, eq, value = token.partition("=")
            found.append((name, value if eq else (args[i + 1] if i + 1 < len(args) else None)))
    return found


def flower_services() -> dict[str, list[str]]:
    return {
        name: argv(svc) for name, svc in services().items() if argv(svc) and re.match(r"(flower|flwr)-", argv(svc)[0])
    }


def supernodes() -> dict[str, list[str]]:
    return {name: args for name, args in flower_services().items() if args[0] == "flower-supernode"}


@functools.cache
def help_text(*cmd: str) -> str:
    """`cmd --help` of the installed binaries (same environment as this interpreter)."""
    exe = Path(sys.executable).parent / cmd[0]
    full = [str(exe), *cmd[1:]] if exe.exists() else list(cmd)
    proc = subprocess.run([*full, "--help"], capture_output=True, text=True, timeout=120, env=HELP_ENV, cwd=ROOT)
    assert proc.returncode == 0, f"{cmd} --help failed:\n{proc.stdout}{proc.stderr}"
    return proc.stdout


def accepted(help_: str) -> tuple[set[str], set[str], dict[str, set[str]]]:
    """Options argparse lists (two-space indented entries, not prose), those it calls deprecated (renamed flags
    often live on as deprecated aliases), and the choices it shows for some."""
    entries = re.split(r"^(?=  (?:-\w, )?--[\w-]+)", help_, flags=re.M)[1:]
    options = {re.match(r"  (?:-\w, )?(--[\w-]+)", e)[1]: e for e in entries}
    deprecated = {opt for opt, entry in options.items() if "deprecated" in entry.lower()}
    choices = {opt: set(vals.split(",")) for opt, vals in re.findall(r"(--[\w-]+) \{([^}]*)\}", help_)}
    return set(options), deprecated, choices


def instructions(dockerfile: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    lines = [line for line in dockerfile.read_text().splitlines() if not line.lstrip().startswith("#")]
    joined = re.sub(r"\\\n", " ", "\n".join(lines))
    return [
        (kind.upper(), rest.strip())
        for kind, _, rest in (line.strip().partition(" ") for line in joined.splitlines())
        if kind
    ]


def arg_defaults(dockerfile: Path) -> dict[str, str]:
    return dict(a.split("=", 1) for kind, a in instructions(dockerfile) if kind == "ARG" and "=" in a)


def mounts_certs(service: dict) -> bool:
    return any(m.startswith("certs:") and m.split(":")[1] == CERTS_MOUNT for m in service.get("volumes", []))


def is_under(path: str, parent: str) -> bool:
    return PurePosixPath(path) == PurePosixPath(parent) or PurePosixPath(parent) in PurePosixPath(path).parents


def test_compose_files_parse_and_fit_together():
    base, gpu = load(COMPOSE), load(GPU_OVERRIDE)
    assert base["services"] and gpu["services"]
    assert set(gpu["services"]) <= set(base["services"]), "the override may only extend services of the base file"
    declared = set(base.get("volumes") or {})
    for name, svc in base["services"].items():
        for mount in svc.get("volumes", []):
            source = mount.split(":")[0]
            if not source.startswith((".", "/", "$", "~")):
                assert source in declared, f"{name}: volume {source!r} is not declared"
        if "build" in svc:
            build = svc["build"]
            dockerfile = COMPOSE.parent / build["context"] / build.get("dockerfile", "Dockerfile")
            assert dockerfile.exists(), f"{name}: {dockerfile} missing"


def test_flower_images_pin_the_installed_flwr_version():
    assert DOCKERFILES, "no Dockerfiles in deploy/docker"
    seen = set()
    for dockerfile in DOCKERFILES:
        stages: list[str] = []
        for kind, args in instructions(dockerfile):
            if kind != "FROM":
                continue
            words = [w for w in args.split() if not w.startswith("--")]
            image = words[0]
            if "$" in image or image in stages:  # a build stage of this file, e.g. base-${ROLE}
                assert any(re.fullmatch(re.sub(r"\\\$\\\{\w+\\\}", ".+", re.escape(image)), s) for s in stages), image
            else:
                match = re.fullmatch(r"flwr/([\w-]+):(\d[^-]*)(-.*)?", image)
                assert match, f"{dockerfile.name}: base {image!r} is not an official flwr image with a version tag"
                assert match[2] == FLWR_VERSION, f"{dockerfile.name}: {image} but flwr {FLWR_VERSION} is installed"
                seen.add(match[1])
            if len(words) >= 3 and words[1].upper() == "AS":
                stages.append(words[2])
    assert {"superlink", "supernode", "superexec"} <= seen, seen
    for name, svc in services().items():
        image = svc.get("image", "")
        if image.startswith("flwr/"):
            assert image.split(":")[1].split("-")[0] == FLWR_VERSION, f"{name}: {image}"


def test_compose_build_args_select_existing_stages():
    """`FROM base-${ROLE}` must resolve for the ROLE each service builds with (and the default)."""
    for name, svc in services().items():
        if "build" not in svc:
            continue
        dockerfile = COMPOSE.parent / svc["build"]["context"] / svc["build"].get("dockerfile", "Dockerfile")
        args = {**arg_defaults(dockerfile), **{k: str(v) for k, v in (svc["build"].get("args") or {}).items()}}
        stages = [a.split()[-1] for kind, a in instructions(dockerfile) if kind == "FROM" and " AS " in a.upper()]
        for kind, a in instructions(dockerfile):
            if kind == "FROM" and "$" in a:
                resolved = re.sub(r"\$\{(\w+)\}", lambda m, args=args: args[m[1]], a.split()[0])
                assert resolved in stages, f"{name}: FROM {a} resolves to {resolved}, not a stage of {dockerfile.name}"


@pytest.mark.parametrize("service", sorted(flower_services()))
def test_every_flower_flag_is_accepted_by_the_installed_binary(service):
    args = argv(services()[service])
    assert "entrypoint" in services()[service], f"{service}: set the entrypoint so the binary is explicit"
    options, deprecated, choices = accepted(help_text(args[0]))
    for option, value in long_options(args[1:]):
        assert option in options, f"{service}: {args[0]} {FLWR_VERSION} does not accept {option}"
        assert option not in deprecated, f"{service}: {args[0]} {FLWR_VERSION} says {option} is deprecated"
        if option in choices:
            assert value in choices[option], f"{service}: {option} {value} not in {sorted(choices[option])}"


def test_supernodes_partitions_keys_and_threads():
    from flwr.common.config import parse_config_args

    nodes = supernodes()
    assert len(nodes) == 3, sorted(nodes)
    partitions, keys, models = [], set(), []
    for name, args in nodes.items():
        opts = dict(long_options(args[1:]))
        config = parse_config_args([opts["--node-config"]])  # raises on a malformed node-config
        assert config["num-partitions"] == 3, (name, config)
        partitions.append(config["partition-id"])
        models.append(config.get("model"))
        assert opts["--auth-supernode-private-key"] == f"{CERTS_MOUNT}/node-{config['partition-id']}.key", name
        keys.add(opts["--auth-supernode-private-key"])
        assert "--insecure" not in opts and opts["--root-certificates"] == f"{CERTS_MOUNT}/ca.crt", name
        env = services()[name]["environment"]
        assert "OMP_NUM_THREADS" in env, f"{name}: co-located SuperNodes need OMP_NUM_THREADS"
    assert sorted(partitions) == [0, 1, 2] and len(keys) == 3
    assert "qwen2.5-coder-0.5b-instruct" in models, "one node should show a heterogeneous model"
    superlink = dict(long_options(argv(services()["superlink"])[1:]))
    assert "--enable-supernode-auth" in superlink and "--insecure" not in superlink
    assert superlink["--database"] != ":flwr-in-memory:"
    database_dir = str(PurePosixPath(superlink["--database"]).parent)
    assert any(
        m.split(":")[1] == database_dir and m.split(":")[0] in load(COMPOSE)["volumes"]
        for m in services()["superlink"]["volumes"]
    ), "the state database must be on a named volume"


def test_certs_service_runs_deploy_certs_with_flags_it_accepts():
    args = argv(services()["certs"])
    assert args[:3] == ["python", "-m", "deploy.certs"], args
    options, _, _ = accepted(help_text(sys.executable, "-m", "deploy.certs"))
    given = dict(long_options(args[3:]))
    for option in given:
        assert option in options, f"deploy.certs does not accept {option}"
    assert given["--out"] == CERTS_MOUNT
    assert mounts_certs(services()["certs"])
    hosts = {h for h in given["--hosts"].split(",") if h and "$" not in h}
    nodes = range(int(given["--nodes"]))
    made = {"ca.crt", "server.pem", "server.key"} | {f"node-{i}.{ext}" for i in nodes for ext in ("key", "pub")}
    # every certificate path the services use is one deploy.certs writes, and every TLS name they dial is in it
    for name, args in flower_services().items():
        for option, value in long_options(args[1:]):
            if value and value.startswith(CERTS_MOUNT + "/"):
                assert value.rsplit("/", 1)[1] in made, f"{name}: {option} {value} is not written by deploy.certs"
                assert mounts_certs(services()[name]), f"{name} does not mount the certs volume at {CERTS_MOUNT}"
            if option in ("--superlink", "--runtime-api-address") and "--insecure" not in args:
                assert value.rsplit(":", 1)[0] in hosts, f"{name}: {value} is not a name in the certificate (--hosts)"
    assert {"localhost", "127.0.0.1"} <= hosts, "the `flwr` CLI on the Docker host dials 127.0.0.1/localhost"


def test_gpu_override_reserves_nvidia_devices_for_every_supernode_only():
    gpu = services(GPU_OVERRIDE)
    with_devices = {
        name
        for name, svc in gpu.items()
        if ((svc.get("deploy") or {}).get("resources") or {}).get("reservations", {}).get("devices")
    }
    assert with_devices == set(supernodes()) == set(gpu), (sorted(with_devices), sorted(supernodes()))
    for name in with_devices:
        for device in gpu[name]["deploy"]["resources"]["reservations"]["devices"]:
            assert device["driver"] == "nvidia" and "gpu" in device["capabilities"], (name, device)
        assert "/whl/cu" in gpu[name]["build"]["args"]["TORCH_INDEX_URL"], f"{name}: CUDA torch wheel expected"
    for name, svc in services().items():
        assert "devices" not in str(svc.get("deploy", "")), f"{name}: the base file must run on CPU-only hosts"


def dockerignored(path: str, patterns: list[str]) -> bool:
    """Approximates Docker's .dockerignore: a pattern excludes a path or any parent dir; later `!` re-includes."""
    parts, result = path.split("/"), False
    for raw in patterns:
        negate, pattern = raw.startswith("!"), raw.lstrip("!").strip("/")
        candidates = [pattern] + ([pattern[3:]] if pattern.startswith("**/") else [])
        if any(fnmatch("/".join(parts[:i]), p) for p in candidates for i in range(1, len(parts) + 1)):
            result = not negate
    return result


def test_no_weights_data_or_keys_in_the_image_project_copy():
    app = DEPLOY / "docker" / "Dockerfile.app"
    steps = instructions(app)
    env: dict[str, tuple[int, str]] = {}
    copies, workdirs = [], []
    for i, (kind, args) in enumerate(steps):
        if kind == "ENV":
            env.update({k: (i, v) for k, _, v in (w.partition("=") for w in shlex.split(args))})
        elif kind == "COPY":
            words = [w for w in args.split() if not w.startswith("--")]
            copies.append((words[:-1], words[-1]))
        elif kind == "WORKDIR":
            workdirs.append(args.strip())
    project = next(dest for sources, dest in copies if sources == ["."])
    cache_step, cache = env["TESSERA_CACHE"]
    assert not is_under(cache, project), f"asset cache {cache} is inside the project copy {project}"
    assert not is_under(cache, workdirs[-1]), f"asset cache {cache} is inside the working directory {workdirs[-1]}"
    runs = [(i, args) for i, (kind, args) in enumerate(steps) if kind == "RUN"]
    assets = [i for i, args in runs if "python -m common.assets" in args]
    torch = [i for i, args in runs if re.search(r"pip install .*torch==\$\{TORCH_VERSION\}.*--index-url", args)]
    project_install = [i for i, args in runs if re.search(r"pip install [^&]*\s\.(\s|$)", args)]
    assert assets and assets[0] > cache_step, "fetch assets after TESSERA_CACHE points outside the project"
    assert torch and project_install and torch[0] < project_install[0], "torch's own wheel must come before the project"
    defaults = arg_defaults(app)
    assert defaults["TORCH_INDEX_URL"].endswith("/whl/cpu")
    pinned = re.search(r'"torch>=([\d.]+)"', (ROOT / "pyproject.toml").read_text())[1]
    assert defaults["TORCH_VERSION"] == pinned, "the image's torch must be the version the project is tested with"

    patterns = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    for path in [
        "runs/latest/metrics.jsonl",
        ".flwr/config.toml",
        ".cache/tessera/model.safetensors",
        "common/__pycache__/assets.cpython-311.pyc",
        ".pytest_cache/v/x",
        "deploy/certs/ca.key",
        "deploy/certs/node-0.key",
        "model.gguf",
        "bench/results/r.json",
        ".git/HEAD",
    ]:
        assert dockerignored(path, patterns), f".dockerignore lets {path} into the build context"
    for path in [
        "pyproject.toml",
        "README.md",
        "LICENSE",
        "deploy/certs.py",
        "deploy/__init__.py",
        "common/assets.py",
        "client_app/app.py",
        "server_app/app.py",
    ]:
        assert (ROOT / path).exists() and not dockerignored(path, patterns), f"{path} is needed in the image"


def test_only_the_fleet_gate_faces_the_nodes():
    """Flower's Control API (start a run: code on every node) shares the SuperLink's port and has no user
    authentication: the SuperLink is published on the host's loopback only and is not on the nodes' network; the
    nodes dial the gate (deploy/fleet_gate.py), which passes the Fleet API only."""
    all_services = services()
    assert all(p.startswith("127.0.0.1:") for p in all_services["superlink"]["ports"]), all_services["superlink"]
    gate = all_services["fleet-gate"]
    assert argv(gate)[:3] == ["python", "-m", "deploy.fleet_gate"]
    options, _, _ = accepted(help_text(sys.executable, "-m", "deploy.fleet_gate"))
    given = dict(long_options(argv(gate)[3:]))
    assert set(given) <= options and given["--superlink"].startswith("superlink:"), given
    gate_port = given["--listen"].rsplit(":", 1)[1]
    assert all(p.endswith(f":{gate_port}:{gate_port}") and p.startswith("${") for p in gate["ports"]), gate["ports"]
    control = set(all_services["superlink"]["networks"])
    for name, args in supernodes().items():
        assert not control & set(all_services[name]["networks"]), f"{name} can reach the SuperLink directly"
        assert dict(long_options(args[1:]))["--superlink"] == f"fleet-gate:{gate_port}", name
