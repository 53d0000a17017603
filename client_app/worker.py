"""A long-lived worker per SuperNode that keeps the 4-bit model loaded between messages (deployment).

In deployment Flower starts a fresh ``flwr-clientapp`` process for every message: importing torch/transformers
and loading + quantising the base model would be paid every round by every node. Instead, the ClientApp process
(``app.py``) stays thin (Flower, numpy, no torch) and hands each message to this worker over a Unix socket; the
worker runs ``handlers.handle`` with the model it already holds and returns the reply and the client's state.

- One worker per node and app version: its socket lives in a 0700 directory named after the process that
  launches ClientApps (the SuperNode's SuperExec) and its file is named after the app's code directory, so a new
  FAB gets a new worker (older ones of the same node are told to stop).
- The first message starts it (``ensure_worker``, under a file lock); it exits when that launcher process is
  gone (the SuperNode stopped or was killed), after ``worker-idle-timeout`` seconds without messages, or when
  told to stop.
- Messages and contexts travel as Flower's own protobufs; the client's state (``context.state``) lives in the
  Context Flower keeps, as in simulation: the worker gets it with each message and returns exactly the keys the
  run's adapter kind and strategy declare (``StrategySpec.state_keys``); other keys (e.g. SecAgg+'s) stay with
  the ClientApp process.
- A handler that raises in the worker raises in the ClientApp with the same message (Flower then sends an error
  reply and the server leaves the node out of the round). A worker that dies mid-message fails that message;
  the next one starts a new worker.
"""

from __future__ import annotations

import argparse
import fcntl
import os
import secrets
import socket
import struct
import subprocess
import sys
import threading
import time
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client, Connection, answer_challenge, deliver_challenge
from pathlib import Path

from flwr.app import Context, Message
from flwr.common.serde import context_from_proto, context_to_proto, message_from_proto, message_to_proto
from flwr.proto.message_pb2 import Context as ProtoContext
from flwr.proto.message_pb2 import Message as ProtoMessage

from common.logs import get_logger

APP_DIR = Path(__file__).resolve().parents[1]
START_TIMEOUT = 300.0
PEER_TIMEOUT = 10.0  # seconds a connected peer has to authenticate and send its request


log = get_logger("tessera.worker")


class WorkerError(RuntimeError):
    """A handler failed in the worker, or the worker could not be reached."""


class WorkerUnavailable(WorkerError):
    """No worker took the request (it exited, e.g. idle); nothing was sent, so the caller may start one and retry."""


def socket_path(launcher_pid: int, app_dir: Path = APP_DIR) -> Path:
    """Where the worker for this launcher (SuperExec) process and app version listens."""
    import hashlib

    base = Path(os.environ.get("TESSERA_WORKER_DIR", "/tmp")) / f"tessera-workers-{os.getuid()}" / str(launcher_pid)
    sock = base / f"{hashlib.sha1(str(app_dir).encode()).hexdigest()[:16]}.sock"
    if len(str(sock)) > 100:  # the AF_UNIX limit is 108 bytes
        raise WorkerError(
            f"worker socket path too long for a Unix socket ({sock}); set TESSERA_WORKER_DIR to a short directory"
        )
    return sock


def _authkey(sock: Path) -> bytes:
    return sock.with_suffix(".key").read_bytes()


def _connect(sock: Path, timeout: float) -> Connection:
    deadline = time.monotonic() + timeout
    while True:
        try:
            return Client(str(sock), family="AF_UNIX", authkey=_authkey(sock))
        except (FileNotFoundError, ConnectionRefusedError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def ensure_worker(launcher_pid: int, idle_timeout: float) -> Path:
    """The socket of a running worker for this node, starting one if there is none."""
    sock = socket_path(launcher_pid)
    _private_dir(sock.parent.parent)
    _private_dir(sock.parent)
    with open(sock.parent / "spawn.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # concurrent ClientApps of one node start one worker
        if _listening(sock):
            return sock
        _stop_other_workers(sock)
        sock.unlink(missing_ok=True)
        key = sock.with_suffix(".key")
        key.touch(mode=0o600)
        key.write_bytes(secrets.token_bytes(32))
        cmd = [
            sys.executable,
            "-m",
            "client_app.worker",
            "--socket",
            str(sock),
            "--watch-pid",
            str(launcher_pid),
            "--idle-timeout",
            str(idle_timeout),
        ]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(APP_DIR), os.environ.get("PYTHONPATH", "")])}
        # its own session: stopping the ClientApp's process group must not stop it; it watches the launcher instead
        proc = subprocess.Popen(cmd, cwd=APP_DIR, env=env, start_new_session=True, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + START_TIMEOUT
        while not _listening(sock):
            if proc.poll() is not None:
                raise WorkerError(
                    f"the model worker exited with code {proc.returncode} before serving (its log is the SuperNode's)"
                )
            if time.monotonic() > deadline:
                proc.kill()
                log.error("model worker: no socket at %s", sock)  # the node's path stays in its log
                raise WorkerError(f"the model worker did not listen on its socket within {START_TIMEOUT:.0f}s")
            time.sleep(0.2)
        return sock


def _private_dir(directory: Path) -> None:
    """Make ``directory`` (mode 0700) or check it: it must be ours and closed to others, because a socket and key
    planted there by another user would receive our messages (and answer with pickles)."""
    directory.mkdir(parents=True, exist_ok=True)
    info = directory.lstat()
    if info.st_uid == os.getuid() and not directory.is_symlink() and info.st_mode & 0o077:
        directory.chmod(0o700)
        info = directory.lstat()
    if info.st_uid != os.getuid() or info.st_mode & 0o077 or directory.is_symlink():
        log.error("model worker: %s (mode %o, uid %d) is not private", directory, info.st_mode & 0o777, info.st_uid)
        raise WorkerError(
            "the model worker's directory is not a private directory of this user (the node's log names it); "
            "remove it or set TESSERA_WORKER_DIR"
        )


def _listening(sock: Path) -> bool:
    """Whether a worker accepts connections on ``sock`` (a bare connect: it does not wait for a busy worker)."""
    probe = socket.socket(socket.AF_UNIX)
    try:
        probe.connect(str(sock))
        return True
    except OSError:
        return False
    finally:
        probe.close()


def _stop_other_workers(keep: Path) -> None:
    """One worker per node: workers of older app versions give their memory back."""
    for other in keep.parent.glob("*.sock"):
        if other != keep and _listening(other):
            try:
                with _connect(other, timeout=0) as conn:
                    conn.send(("stop",))
            except (OSError, EOFError, AuthenticationError):
                pass


def call(sock: Path, kind: str, msg: Message, context: Context, spawn_seconds: float) -> Message:
    """Run ``kind``'s handler in the worker; update ``context.state``'s declared keys; return the reply."""
    request = ("handle", kind, *_encode(msg, context), spawn_seconds)
    try:
        conn = _connect(sock, timeout=10)
    except (OSError, EOFError, AuthenticationError) as err:
        raise WorkerUnavailable(f"no model worker: {type(err).__name__}") from err
    with conn:
        try:
            conn.send(request)
            accepted = conn.recv()
        except (OSError, EOFError) as err:  # it exited (idle) before taking the message: nothing ran
            raise WorkerUnavailable(f"the model worker exited before taking '{kind}': {type(err).__name__}") from err
        if accepted != ("accepted",):
            raise WorkerError(f"the model worker answered {str(accepted)[:40]!r} instead of accepting '{kind}'")
        try:
            answer = conn.recv()
        except (OSError, EOFError) as err:
            raise WorkerError(f"the node's model worker went away during '{kind}': {type(err).__name__}") from err
    if answer[0] == "error":
        raise WorkerError(answer[1])
    reply, worker_context = _decode(answer[1], answer[2])
    for key in answer[3]:  # the declared client-state keys: as the handler left them
        if key in worker_context.state:
            context.state[key] = worker_context.state[key]
        elif key in context.state:
            del context.state[key]
    return reply


def _encode(msg: Message, context: Context) -> tuple[bytes, bytes]:
    """A Message and a Context as Flower's own protobuf bytes (what the SuperNode gives a ClientApp)."""
    return message_to_proto(msg).SerializeToString(), context_to_proto(context).SerializeToString()


def _decode(msg_bytes: bytes, ctx_bytes: bytes) -> tuple[Message, Context]:
    return message_from_proto(ProtoMessage.FromString(msg_bytes)), context_from_proto(
        ProtoContext.FromString(ctx_bytes)
    )


# ---------------------------------------------------------------------------------------------------- worker side
def serve(sock: Path, watch_pid: int, idle_timeout: float) -> None:
    from . import runtime
    from .handlers import handle

    activity = {"last": time.monotonic(), "busy": False}
    lock = threading.Lock()  # the idle exit and the start of a message exclude each other
    _exit_when(lambda: not _alive(watch_pid), f"launcher process {watch_pid} is gone", sock, remove_dir=True)
    _exit_when(
        lambda: not activity["busy"] and time.monotonic() - activity["last"] > idle_timeout,
        f"idle for {idle_timeout:.0f}s",
        sock,
        lock=lock,
    )
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(sock))
    server.listen(16)  # ClientApps queue while busy
    key = _authkey(sock)
    log.info("model worker %d serving %s (app %s)", os.getpid(), sock, APP_DIR)
    while True:
        try:
            conn = _accept(server, key)
            request = _parse_request(conn.recv())
        except (EOFError, OSError, AuthenticationError, ValueError) as err:
            # a liveness probe, a ClientApp that left, a silent or malformed peer: dropped, the worker goes on
            if isinstance(err, ValueError):
                log.warning("model worker: a malformed request refused: %s", err)
            continue
        with conn:
            if request[0] == "stop":
                log.info("model worker %d: stopping (a newer app version has its own worker)", os.getpid())
                _cleanup(sock)
                os._exit(0)
            _, kind, msg_bytes, ctx_bytes, spawn_seconds = request
            with lock:
                activity["busy"] = True
            try:
                conn.send(("accepted",))  # from here on the handler runs: the ClientApp must not retry elsewhere
            except OSError:
                activity.update(last=time.monotonic(), busy=False)
                continue
            log.info("model worker: '%s' (its ClientApp process took %.1fs to hand it over)", kind, spawn_seconds)
            answer: tuple[str, bytes, bytes, tuple[str, ...]] | tuple[str, str]  # ("ok", ...) or ("error", why)
            try:
                msg, context = _decode(msg_bytes, ctx_bytes)
                reply = handle(kind, msg, context, spawn_seconds)
                answer = ("ok", *_encode(reply, context), runtime.declared_state_keys(context))
            except Exception as err:  # the ClientApp raises it; the worker keeps serving
                log.error("model worker: '%s' failed", kind, exc_info=True)
                answer = ("error", f"{type(err).__name__}: {err}")
            activity.update(last=time.monotonic(), busy=False)
            try:
                conn.send(answer)
            except OSError:
                log.warning("model worker: the ClientApp left before its '%s' reply", kind)


def _accept(server: socket.socket, key: bytes) -> Connection:
    """The next peer, authenticated as ``Listener(authkey=...)`` would; reads time out after ``PEER_TIMEOUT``
    seconds, so that a peer that connects and stays silent cannot block every ClientApp of the node."""
    raw, _ = server.accept()
    raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", int(PEER_TIMEOUT), 0))
    conn = Connection(raw.detach())
    try:
        deliver_challenge(conn, key)
        answer_challenge(conn, key)
    except BaseException:
        conn.close()
        raise
    return conn


def _parse_request(request: object) -> tuple:
    """A request is ("stop",) or ("handle", kind, message bytes, context bytes, seconds); anything else is refused."""
    if isinstance(request, tuple) and request == ("stop",):
        return request
    if (
        isinstance(request, tuple)
        and len(request) == 5
        and request[0] == "handle"
        and request[1] in ("query", "train", "evaluate")
        and isinstance(request[2], bytes)
        and isinstance(request[3], bytes)
        and isinstance(request[4], (int, float))
    ):
        return request
    raise ValueError(f"not a worker request: {str(request)[:80]!r}")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _exit_when(
    condition, why: str, sock: Path, every: float = 1.0, remove_dir: bool = False, lock: threading.Lock | None = None
) -> None:
    """Exit the process once ``condition()`` holds; checked (and the exit done) under ``lock``, so that a message
    the worker has accepted is never cut off, and a ClientApp whose message was not accepted can start another."""
    guard = lock or threading.Lock()

    def watch() -> None:
        while True:
            with guard:
                if condition():
                    print(f"[tessera] model worker {os.getpid()}: exiting, {why}", flush=True)
                    _cleanup(sock)
                    if remove_dir:  # the launcher is gone: nobody starts workers in its directory any more
                        import shutil

                        shutil.rmtree(sock.parent, ignore_errors=True)
                    os._exit(0)
            time.sleep(every)

    threading.Thread(target=watch, daemon=True).start()


def _cleanup(sock: Path) -> None:
    for path in (sock, sock.with_suffix(".key")):
        path.unlink(missing_ok=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--socket", type=Path, required=True)
    parser.add_argument("--watch-pid", type=int, required=True, help="exit when this process is gone")
    parser.add_argument("--idle-timeout", type=float, default=1800.0)
    args = parser.parse_args()
    serve(args.socket, args.watch_pid, args.idle_timeout)


if __name__ == "__main__":
    main()
