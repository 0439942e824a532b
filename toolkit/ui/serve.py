"""`./start_toolkit.sh ui`: serves the web UI with uvicorn on a socket bound here first, so that a port in use is
named before anything starts. Localhost by default; any other address needs a token (given, or made and printed
inside the URL)."""

from __future__ import annotations

import argparse
import errno
import fcntl
import os
import secrets
import socket
from pathlib import Path

from toolkit.errors import UserError

DEFAULT_PORT = 8642


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to listen on (default 127.0.0.1; any other needs a token)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port (default {DEFAULT_PORT}; 0: any free one)")
    parser.add_argument("--token", default=None,
                        help="the token requests must carry (default: none on localhost, a new one otherwise)")
    parser.add_argument("--outputs", default="outputs", metavar="DIR",
                        help="the outputs root: its run folders are listed, new runs go there (default outputs)")


def bind(host: str, port: int) -> socket.socket:
    """A listening socket, or a UserError naming the address and the fix."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as err:
        raise UserError(f"--host {host}: not an address of this machine ({err.strerror})\n"
                        "  fix: --host 127.0.0.1 (this machine only) or --host 0.0.0.0 (every interface)") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restart while old connections linger
    try:
        sock.bind(address)
        sock.listen(128)
    except OSError as err:
        sock.close()
        if err.errno == errno.EADDRINUSE:
            raise UserError(f"port {port} on {host} is already in use (another program, or another `ui`)\n"
                            f"  fix: --port N with a free port (--port 0 picks one), or stop what listens there") from None
        if err.errno == errno.EACCES:
            raise UserError(f"port {port} on {host}: permission denied (ports below 1024 need root)\n"
                            "  fix: --port 8642 or another above 1024") from None
        raise UserError(f"cannot listen on {host}:{port}: {err.strerror}\n  fix: check --host and --port") from None
    sock.set_inheritable(False)
    return sock


def hold_outputs_root(root: Path, url: str) -> int:
    """One UI per outputs root (it alone writes .ui/jobs.json): a flock on .ui/server.lock, held until exit."""
    lock = root / ".ui" / "server.lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        other = os.read(fd, 4096).decode("utf-8", "replace").strip()
        os.close(fd)
        raise UserError(f"another `ui` already serves {root} ({other or 'starting'})\n"
                        "  fix: use that one, or give this one another --outputs folder") from None
    os.ftruncate(fd, 0)
    os.write(fd, f"pid {os.getpid()}, {url}\n".encode())
    return fd


def serve(args: argparse.Namespace) -> int:
    import uvicorn

    from toolkit.ui.app import create_app
    from toolkit.ui.auth import LOCAL_HOSTS

    root = Path(args.outputs).resolve()
    if root.exists() and not root.is_dir():
        raise UserError(f"--outputs {args.outputs}: a file, not a folder\n  fix: give the folder that holds the runs")
    created = not root.exists()
    if created and not root.parent.is_dir():  # a mistyped path: not a tree of folders made on its say-so
        raise UserError(f"--outputs {args.outputs}: {root.parent} does not exist\n  fix: give a folder that exists, "
                        "or one to create inside an existing folder")
    root.mkdir(exist_ok=True)
    local = args.host in LOCAL_HOSTS
    token = args.token or (None if local else secrets.token_urlsafe(18))
    sock = bind(args.host, args.port)
    port = sock.getsockname()[1]
    shown = socket.gethostname() if args.host in ("0.0.0.0", "::") else args.host
    shown = f"[{shown}]" if ":" in shown else shown
    url = f"http://{shown}:{port}/" + (f"?token={token}" if token else "")
    fd = hold_outputs_root(root, url.split("?")[0])
    app = create_app(root, token=token, local_only=local and token is None)
    print(f"toolkit ui: runs in {root}{' (a new folder)' if created else ''}\n  open {url}", flush=True)
    if not local and not args.token:
        print("  (a new token: requests without it get 401; --token sets your own)", flush=True)
    print("  Ctrl-C stops the UI; the runs it started keep running", flush=True)
    config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2, lifespan="on")
    try:
        uvicorn.Server(config).run(sockets=[sock])
    finally:
        os.close(fd)
    return 0

