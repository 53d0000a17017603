"""Static checks of the Docker Compose demo in deploy/ (no engine needed; tests/test_e2e_docker.py runs it): the files
parse, the image needs no registry beyond its BASE, every Flower flag is one the installed binaries accept
(`<binary> --help`), every certificate path is one deploy/certs.py writes, mounted read-only, GPUs go to SuperNodes
only, and no build input (CA bundle, wheels), weights, data or keys reach the final image."""

from __future__ import annotations

import functools
import importlib.metadata
import os
import re
import shlex
import shutil
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
DOCKERFILE = DEPLOY / "docker" / "Dockerfile"
DEMO = DEPLOY / "docker" / "demo.sh"
FLWR_VERSION = importlib.metadata.version("flwr")
CERTS_MOUNT = "/app/certs"
ASSETS = "/srv/assets"  # stands in for $TESSERA_ASSETS (required by the compose file)
MEMBERS = "/srv/members"  # stands in for $TESSERA_MEMBER_DATA (required: node-<i>/ is node i's own data)
HELP_ENV = {**os.environ, "FLWR_TELEMETRY_ENABLED": "0", "FLWR_DISABLE_UPDATE_CHECK": "1"}  # --help stays offline


@functools.cache
def load(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def interpolate(value, env: dict[str, str]):
    """Compose's variable substitution (${VAR}, ${VAR:-default}, ${VAR-default}, ${VAR:?error}) over a parsed file."""
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def one(match: re.Match) -> str:
        name, op, arg = match[1], match[2] or "", match[3] or ""
        if name in env and (env[name] or op not in (":-", ":?")):
            return env[name]
        if op.endswith("?"):
            raise KeyError(f"{name} must be set: {arg}")
        return arg if op else ""

    return re.sub(r"\$\{(\w+)(:?[-?])?([^}]*)\}", one, value)


def services(path: Path = COMPOSE, **env: str) -> dict[str, dict]:
    """The file's services with variables substituted as compose would, from ``env`` (else their defaults)."""
    return interpolate(load(path)["services"], {"TESSERA_ASSETS": ASSETS, "TESSERA_MEMBER_DATA": MEMBERS, **env})


def mounts(service: dict) -> dict[str, tuple[str, str]]:
    """container path -> (source, mode) of every volume of a service."""
    found = {}
    for volume in service.get("volumes", []):
        source, target, *mode = volume.split(":")
        found[target] = (source, mode[0] if mode else "rw")
    return found


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


def is_under(path: str, parent: str) -> bool:
    return PurePosixPath(path) == PurePosixPath(parent) or PurePosixPath(parent) in PurePosixPath(path).parents


def test_compose_files_parse_and_fit_together():
    base, gpu = load(COMPOSE), load(GPU_OVERRIDE)
    assert base["services"] and gpu["services"]
    assert set(gpu["services"]) <= set(base["services"]), "the override may only extend services of the base file"
    declared = set(base.get("volumes") or {})
    for name, svc in services().items():
        for source, _ in mounts(svc).values():
            if not source.startswith((".", "/")):
                assert source in declared, f"{name}: volume {source!r} is not declared"
        if "build" in svc:
            build = svc["build"]
            assert (COMPOSE.parent / build["context"] / build["dockerfile"]).resolve() == DOCKERFILE, name
    with pytest.raises(KeyError, match="TESSERA_ASSETS"):  # the asset cache must be named, never guessed
        interpolate(load(COMPOSE)["services"], {})


def test_image_needs_no_registry_but_its_base():
    """Every FROM is the BASE argument or a stage of the file; BASE defaults to the official Python image, and
    deploy/docker/build-base.sh makes the registry-free one; torch is the version the project is tested with."""
    stages: list[str] = []
    for kind, args in instructions(DOCKERFILE):
        if kind == "FROM":
            words = args.split()
            assert words[0] == "${BASE}" or words[0] in stages, f"FROM {words[0]} would need a registry"
            assert len(words) == 3 and words[1].upper() == "AS", f"name every stage: FROM {args}"
            stages.append(words[2])
    defaults = arg_defaults(DOCKERFILE)
    assert defaults["BASE"] == "python:3.11-slim"
    assert defaults["TORCH_INDEX_URL"].endswith("/whl/cpu")
    pinned = re.search(r'"torch>=([\d.]+)"', (ROOT / "pyproject.toml").read_text())[1]
    assert defaults["TORCH_VERSION"] == pinned, "the image's torch must be the version the project is tested with"
    assert "docker import" in (DEPLOY / "docker" / "build-base.sh").read_text()
    assert "local/debian:bookworm" in DEMO.read_text() and "build-base.sh" in DEMO.read_text()
    assert not any(line.startswith("# syntax=") for line in DOCKERFILE.read_text().splitlines()), "pulls a frontend"
    built = [svc for svc in services().values() if "build" in svc]
    assert len(built) == 1 and built[0]["build"]["args"]["BASE"] == "python:3.11-slim", "one image, built once"
    assert (
        services(TESSERA_BASE="local/debian:bookworm")["superlink"]["build"]["args"]["BASE"] == "local/debian:bookworm"
    )


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
    partitions = []
    for name, args in nodes.items():
        opts = dict(long_options(args[1:]))
        config = parse_config_args([opts["--node-config"]])  # raises on a malformed node-config
        assert config["num-partitions"] == 3, (name, config)
        partitions.append(config["partition-id"])
        assert "--insecure" not in opts and opts["--root-certificates"] == f"{CERTS_MOUNT}/ca.crt", name
        # each node holds the CA and its own private key, nothing else of the certificates
        certs = {t: s for t, (s, _) in mounts(services()[name]).items() if is_under(t, CERTS_MOUNT)}
        key = certs[opts["--auth-supernode-private-key"]]
        assert Path(key).name == f"node-{config['partition-id']}.key", (name, key)
        assert sorted(Path(s).name for s in certs.values()) == sorted(["ca.crt", Path(key).name]), (name, certs)
        assert "OMP_NUM_THREADS" in services()[name]["environment"], f"{name}: co-located nodes need OMP_NUM_THREADS"
    assert sorted(partitions) == [0, 1, 2]
    superlink = dict(long_options(argv(services()["superlink"])[1:]))
    assert "--enable-supernode-auth" in superlink and "--insecure" not in superlink
    assert superlink["--database"] != ":flwr-in-memory:"
    database_dir = str(PurePosixPath(superlink["--database"]).parent)
    source, _ = mounts(services()["superlink"])[database_dir]
    assert source in load(COMPOSE)["volumes"], "the state database (registered keys) must be on a named volume"


def test_each_supernode_reads_its_own_data_volume_and_nothing_else_mounts_member_data():
    """A member's data is mounted read-only in its own SuperNode only, and its node-config data-path names a file
    there: the run config (the SuperLink's) never names it."""
    from flwr.common.config import parse_config_args

    for name, args in supernodes().items():
        config = parse_config_args([dict(long_options(args[1:]))["--node-config"]])
        own = {t: m for t, m in mounts(services()[name]).items() if m[0].startswith(MEMBERS)}
        assert own == {"/app/data": (f"{MEMBERS}/node-{config['partition-id']}", "ro")}, (name, own)
        assert PurePosixPath(config["data-path"]).parent == PurePosixPath("/app/data"), (name, config)
    for name in ("superlink", "fleet-gate"):
        assert not any(s.startswith(MEMBERS) for s, _ in mounts(services()[name]).values()), name
    with pytest.raises(KeyError, match="TESSERA_MEMBER_DATA"):  # the members' data must be named, never guessed
        interpolate(load(COMPOSE)["services"], {"TESSERA_ASSETS": ASSETS})


def test_certificates_are_ones_deploy_certs_writes_mounted_read_only():
    hosts = set(re.search(r'--hosts "([^"$]*)', DEMO.read_text())[1].strip(",").split(","))
    made = {"ca.crt", "server.pem", "server.key"} | {f"node-{i}.{ext}" for i in range(3) for ext in ("key", "pub")}
    for name, svc in services().items():
        for target, (source, mode) in mounts(svc).items():
            if is_under(target, CERTS_MOUNT):
                assert mode == "ro", f"{name}: {target} must be mounted read-only"
                assert Path(source).name in made, f"{name}: {source} is not a file deploy.certs writes"
                assert source.startswith("./certs/docker/"), f"{name}: {source} (default TESSERA_DOCKER_CERTS)"
        for option, value in long_options(argv(svc)[1:]):
            if value and value.startswith(CERTS_MOUNT + "/"):
                assert value in mounts(svc), f"{name}: {option} {value} is not mounted"
            if option == "--superlink":
                assert value.rsplit(":", 1)[0] in hosts, f"{name}: {value} is not a name in the certificate (--hosts)"
    assert {"localhost", "127.0.0.1", "superlink", "fleet-gate"} <= hosts, hosts


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
        assert gpu[name]["image"] != services()[name]["image"], f"{name}: the CUDA image needs a tag of its own"
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


def stages(dockerfile: Path) -> dict[str, list[tuple[str, str]]]:
    """Stage name -> its instructions."""
    found: dict[str, list[tuple[str, str]]] = {}
    current: list[tuple[str, str]] = []
    for kind, args in instructions(dockerfile):
        if kind == "FROM":
            current = found.setdefault(args.split()[-1], [])
        current.append((kind, args))
    return found


def test_no_build_inputs_weights_data_or_keys_in_the_final_image():
    """The CA bundle and wheels given to pip stay in the `deps` stage; the final stage takes the venv and the
    project's files less those inputs; the asset cache is outside the project copy and the app directory, and is
    mounted read-only by every service that loads the model; .dockerignore keeps weights, data, keys, runs out."""
    by_stage = stages(DOCKERFILE)
    final_name = list(by_stage)[-1]
    final = by_stage[final_name]
    inputs = "deploy/docker/build-inputs"
    for name, steps in by_stage.items():
        copies_inputs = any(kind == "COPY" and args.split()[0] == inputs + "/" for kind, args in steps)
        assert copies_inputs == (name == "deps"), f"stage {name}: only `deps` may see {inputs}"
    final_copies = [args.split() for kind, args in final if kind == "COPY"]
    assert final_copies == [["--from=deps", "/opt/venv", "/opt/venv"], ["--from=code", "/opt/tessera", "/opt/tessera"]]
    assert any(kind == "RUN" and f"rm -rf /opt/tessera/{inputs}" in args for kind, args in by_stage["code"])
    deps_runs = [args for kind, args in by_stage["deps"] if kind == "RUN"]
    torch = next(i for i, a in enumerate(deps_runs) if '"torch==${TORCH_VERSION}"' in a)
    requirements = next(i for i, a in enumerate(deps_runs) if "-r /tmp/requirements.txt" in a)
    assert torch < requirements, "torch's own wheel must come before the dependencies"
    assert any(kind == "USER" and args != "root" for kind, args in final), "the final image runs as a non-root user"
    env = {k: v for kind, args in final if kind == "ENV" for k, _, v in (w.partition("=") for w in shlex.split(args))}
    workdir = [args for kind, args in final if kind == "WORKDIR"][-1]
    cache = env["TESSERA_CACHE"]
    assert not is_under(cache, "/opt/tessera") and not is_under(cache, workdir), cache
    for name in ["superlink", *supernodes()]:
        seen = mounts(services()[name])
        for sub in ("models", "data"):
            assert seen[f"{cache}/{sub}"] == (f"{ASSETS}/{sub}", "ro"), f"{name}: mount the asset cache read-only"

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
        "deploy/certs/docker/node-0.key",
        "model.gguf",
        "bench/results/r.json",
        ".git/HEAD",
        ".mypy_cache/3.11/x.json",
    ]:
        assert dockerignored(path, patterns), f".dockerignore lets {path} into the build context"
    for path in [
        "pyproject.toml",
        "README.md",
        "deploy/certs.py",
        "deploy/fleet_gate.py",
        "common/assets.py",
        "client_app/app.py",
        "server_app/app.py",
        "deploy/docker/build-inputs/README.md",
    ]:
        assert (ROOT / path).exists() and not dockerignored(path, patterns), f"{path} is needed in the build context"


def test_only_the_fleet_gate_faces_the_nodes():
    """Flower's Control API (start a run: code on every node) shares the SuperLink's port and has no user
    authentication: the SuperLink is published on the host's loopback only (unless the operator says otherwise) and
    is not on the nodes' network; the nodes dial the gate (deploy/fleet_gate.py), which passes the Fleet API only
    and is published nowhere by default."""
    all_services = services()
    assert [p.split(":")[0] for p in all_services["superlink"]["ports"]] == ["127.0.0.1"], all_services["superlink"]
    published = services(TESSERA_PUBLISH="10.0.0.5")["superlink"]["ports"]
    assert published == ["10.0.0.5:9092:9092"], published
    assert all(not svc.get("ports") for name, svc in all_services.items() if name != "superlink")
    gate = all_services["fleet-gate"]
    assert argv(gate)[:3] == ["python", "-m", "deploy.fleet_gate"]
    options, _, _ = accepted(help_text(sys.executable, "-m", "deploy.fleet_gate"))
    given = dict(long_options(argv(gate)[3:]))
    assert set(given) <= options and given["--superlink"].startswith("superlink:"), given
    gate_port = given["--listen"].rsplit(":", 1)[1]
    control = set(all_services["superlink"]["networks"])
    for name, args in supernodes().items():
        assert not control & set(all_services[name]["networks"]), f"{name} can reach the SuperLink directly"
        assert dict(long_options(args[1:]))["--superlink"] == f"fleet-gate:{gate_port}", name


def compose_cli() -> list[str] | None:
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    if shutil.which("docker") and subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0:
        return ["docker", "compose"]
    return None


@pytest.mark.skipif(compose_cli() is None, reason="no docker-compose (Debian: apt-get install docker-compose)")
def test_docker_compose_itself_accepts_the_files_with_the_gpu_override():
    """`docker-compose config` (no engine needed) merges the base and GPU files: what a GPU host would start."""
    env = {
        **os.environ,
        "TESSERA_ASSETS": ASSETS,
        "TESSERA_MEMBER_DATA": MEMBERS,
        "COMPOSE_PROJECT_NAME": "tessera-config-check",
    }
    cmd = [*(compose_cli() or []), "-f", str(COMPOSE), "-f", str(GPU_OVERRIDE), "config"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    merged = yaml.safe_load(done.stdout)["services"]
    for name in supernodes():
        devices = merged[name]["deploy"]["resources"]["reservations"]["devices"]
        assert devices[0]["driver"] == "nvidia" and merged[name]["image"] == "tessera:cuda", merged[name]
        assert merged[name]["command"] == services()[name]["command"], f"{name}: the override must keep its flags"
    assert "deploy" not in merged["superlink"]
