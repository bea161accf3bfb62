"""Two nodes on one host, for tests and benchmarks of an engine whose ranks span nodes (DESIGN
§13; tests/support/two_node.py adds pytest's skip and shared folder, bench/multinode/ uses it as
is).

Runs in the test (or bench) process. Node A, the head, is the test process and what it starts as usual:
the root namespaces. Node B is set apart by `TwoNodes` as a second host would be:

- **network**: a namespace of its own (`ectl-<pid>-<n>`), reached from the root one by a veth
  pair only: `head_interface` (`ea<pid>n<n>`, `head_address` 10.213.X.1/30) and
  `node_interface` (`eb<pid>n<n>`, `node_address` 10.213.X.2/30, in the namespace). Node B's
  127.0.0.1 is its own loopback: a listener on the head's loopback is out of its reach, one on
  `head_address` is not. There is no other route out of node B.
- **mounts**: a private tmpfs on /tmp and on /dev/shm, so neither side sees the other's
  files there: `ipc://` sockets, POSIX shared memory (torch's `/dev/shm/torch_*` segments), a
  checkpoint written under /tmp. `node_private` is a folder that exists on node B only. Every
  other path is shared, as a shared filesystem (NFS) is: the venv, the repository, pytest's
  cache folder (`shared_root`, where both nodes find the tiny model: `shared_model`). The
  repository and its venv stay shared when they lie under /tmp (a CI's clean clone): node B's
  anchor mounts them back over its private /tmp at their own paths.
- **host name**: `node-b` (UTS namespace), and an /etc/hosts of its own that resolves it to
  `node_address`, as a cluster's DNS would.
- **environment**: `node_env()`, built from nothing: node B never inherits the head's.

One anchor process (`sh`, blocked reading its stdin) holds node B's mount and UTS namespaces;
`wrap` enters them with nsenter, so every node-B process shares one /tmp and /dev/shm, as the
processes of one host do, and the pid `popen` returns is the program's own (nsenter and
unshare exec; no shell stays in between): killing it kills the program.

**Host interface settings** (what a real multi-node deployment needs too, found here):

- gloo (`torch.distributed`: enginectl's update groups, vLLM's stateless DP group): the one
  address every rank must reach is the rendezvous, the TCPStore's `master_address`: use
  `head_address`, never 127.0.0.1 (node B's connection to it goes to node B's own loopback and
  the join ends GROUP_TIMEOUT). The gloo connections themselves formed across the namespaces
  with torch 2.13 whatever the device: `GLOO_SOCKET_IFNAME` unset (the head's host name
  resolves to 127.0.0.1 here, as on many hosts), or even `lo` on both sides (node B's gloo
  listened on its veth address all the same). `GLOO_SOCKET_IFNAME` naming an interface
  the node lacks fails at once ("Unable to find address for: X"): it is per node, never one
  value for all. `head_env` and `node_env` set it to each node's own veth end, as a host with
  several interfaces needs.
- vLLM: `VLLM_HOST_IP` is the address a process announces to the others; unset, vLLM takes
  the interface of the default route (node B has none). Set it to the node's own address.
- ZMQ: bind `tcp://<head_address>:PORT` (or `tcp://*:PORT`) and connect to it from node B;
  `ipc://` and `tcp://127.0.0.1` endpoints stay on their node.

Names and addresses are unique per process and instance (the pid and a counter); cleanup
deletes exactly what this instance created, by name, and kills only the processes it started
(and their descendants). `TwoNodes().start()` raises NodeSetupError, saying why, when the host can not make node B (not
root, no `ip`/`nsenter`/`unshare`, namespaces refused); tests/support/two_node.py's `two_nodes()`
skips the test then.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import psutil

from bench.lib.harness import BIN

NODE_HOSTNAME = "node-b"
SUBNET = "10.213"  # the /30s 10.213.X.0/30 are this harness's own
SETUP_TIMEOUT_S = 15.0
KILL_TIMEOUT_S = 15.0
PYTHON_TIMEOUT_S = 60.0
# A node's own engine settings, which its operator would set the same on every node: copied
# from the head's environment when set there. Nothing else of the head's environment crosses.
NODE_PASSTHROUGH = (
    "VLLM_CPU_KVCACHE_SPACE",
    "VLLM_CPU_OMP_THREADS_BIND",
    "VLLM_CPU_NUM_OF_RESERVED_CPU",
    "OMP_NUM_THREADS",
    "VLLM_LOGGING_LEVEL",
)
SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
REQUIRED_TOOLS = ("ip", "nsenter", "unshare")
PRIVATE_PATHS = (Path("/tmp"), Path("/dev/shm"))  # node B mounts its own over these
REPO = Path(__file__).resolve().parents[2]

# Node B's anchor: /etc/hosts naming node-b ($1, bound before /tmp is covered), private /tmp
# and /dev/shm, the host name, the node-private folder ($2); the shared folders that lie under
# /tmp or /dev/shm ($3...: the repository and its venv when checked out there, as CI's clean
# clones are) held on a scratch tmpfs over /mnt while the private ones are mounted, then moved
# back to their own paths, so node B sees them as a shared filesystem; then it holds the
# namespaces until its stdin closes.
_ANCHOR_SCRIPT = (
    'hosts="$1"; private="$2"; hostname="$3"; shift 3'
    ' && mount --bind "$hosts" /etc/hosts'
    " && mount -t tmpfs -o mode=0700 tmpfs /mnt"
    ' && n=0 && for path in "$@"; do n=$((n+1)); mkdir -p /mnt/$n && mount --bind "$path" /mnt/$n || exit 1; done'
    " && mount -t tmpfs -o mode=1777 tmpfs /tmp"
    " && mount -t tmpfs -o mode=1777 tmpfs /dev/shm"
    ' && n=0 && for path in "$@"; do n=$((n+1)); mkdir -p "$path" && mount --move /mnt/$n "$path" || exit 1; done'
    ' && hostname "$hostname"'
    ' && mkdir -p "$private"'
    " && echo ready"
    " && read _"
)


def shared_under_private() -> list[str]:
    """The folders node B must share with the head (the repository, the venv, the checkout the
    venv's enginectl is installed from, when it is another) that lie under
    the paths it gets private copies of (/tmp, /dev/shm): outermost first, none inside another."""
    import enginectl

    installed = Path(enginectl.__file__).resolve().parent  # protos/enginectl of the installed checkout
    source = next((p for p in installed.parents if (p / "pyproject.toml").exists()), installed)
    candidates = sorted({str(REPO), str(BIN.parent.resolve()), str(source)})
    out: list[str] = []
    for path in candidates:
        if any(Path(path).is_relative_to(p) for p in PRIVATE_PATHS) and not any(
            Path(path).is_relative_to(kept) for kept in out
        ):
            out.append(path)
    return out


_instances = itertools.count()


class NodeSetupError(RuntimeError):
    """Making node B failed: the step that failed and what it said."""


class HostCannotMakeNodes(NodeSetupError):
    """This host lacks what node B needs (root, the tools): tests skip; any other
    NodeSetupError is a failure (tests/support/two_node.py)."""


def _check_host() -> None:
    if os.geteuid() != 0:
        raise HostCannotMakeNodes("network namespaces need root (euid is not 0)")
    missing = [tool for tool in REQUIRED_TOOLS if shutil.which(tool) is None]
    if missing:
        raise HostCannotMakeNodes(f"missing tools: {', '.join(missing)}")


def _run(argv: Sequence[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        list(argv), capture_output=True, text=True, timeout=SETUP_TIMEOUT_S, stdin=subprocess.DEVNULL, check=False
    )


def _must(argv: Sequence[str]) -> str:
    """Run a setup command; NodeSetupError with its output if it fails."""
    done = _run(argv)
    if done.returncode != 0:
        raise NodeSetupError(f"`{' '.join(argv)}` failed ({done.returncode}): {done.stderr.strip()}")
    return done.stdout


def _subnet_in_use() -> set[int]:
    """The X of every 10.213.X.* address on the root namespace's interfaces."""
    shown = _must(["ip", "-4", "-o", "addr", "show"])
    return {int(x) for x in re.findall(rf"inet {re.escape(SUBNET)}\.(\d+)\.", shown)}


class Bridge:
    """One segment for several nodes, as a switch joins hosts: a bridge in the root network
    namespace (`ec<pid>b<n>`) with `address` 10.213.X.1/24, the head's (and a trainer's) address
    on it; each `TwoNodes(bridge=...)` plugs its node in at the next address (.2, .3, ...),
    so the nodes reach each other as well as the head. Delete it after its nodes are closed."""

    def __init__(self) -> None:
        n = next(_instances)
        self.interface = f"ec{os.getpid()}b{n}"
        self.address = ""
        self._hosts = itertools.count(2)
        self._made = False

    def start(self) -> Bridge:
        _check_host()
        used = _subnet_in_use()
        x = next((x for x in range((os.getpid() * 11) % 256, 256) if x not in used), None)
        x = x if x is not None else next((x for x in range(256) if x not in used), None)
        if x is None:
            raise NodeSetupError(f"every {SUBNET}.X.0/24 is in use")
        try:
            _must(["ip", "link", "add", self.interface, "type", "bridge"])
            self._made = True
            self.address = f"{SUBNET}.{x}.1"
            _must(["ip", "addr", "add", f"{self.address}/24", "dev", self.interface])
            _must(["ip", "link", "set", self.interface, "up"])
        except BaseException:
            self.close()
            raise
        return self

    def next_address(self) -> str:
        return f"{self.address.rsplit('.', 1)[0]}.{next(self._hosts)}"

    def close(self) -> None:
        """Delete the bridge by its name (idempotent); raises if the deletion failed."""
        if not self._made:
            return
        done = _run(["ip", "link", "del", self.interface])
        self._made = False
        if done.returncode != 0:
            raise RuntimeError(f"ip link del {self.interface}: {done.stderr.strip()}")

    def __enter__(self) -> Bridge:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


class TwoNodes:
    """Node B beside this host's root namespaces (the module docstring says what is apart).

    `with TwoNodes() as nodes:` sets it up (NodeSetupError if the host can not) and tears it
    down; `wrap`, `popen` and `python` run programs as node B, `node_env` is their environment,
    `head_env` what the head's own processes add to theirs.
    """

    def __init__(self, bridge: Bridge | None = None, hostname: str = NODE_HOSTNAME) -> None:
        n = self._instance = next(_instances)
        pid = os.getpid()
        self.namespace = f"ectl-{pid}-{n}"
        self._veth = f"ea{pid}n{n}"  # at most 15 characters: 2 + 7 + 1 + 5
        # The head's end of the link to node B: the veth end, or with a bridge the bridge.
        self.head_interface = bridge.interface if bridge is not None else self._veth
        self.node_interface = f"eb{pid}n{n}"
        self.bridge = bridge
        self.hostname = hostname
        self.head_address = ""
        self.node_address = ""
        self.node_private = Path("/tmp") / f"{self.namespace}-private"
        self.anchor: subprocess.Popen[bytes] | None = None
        self._created: list[str] = []  # "netns", "link": what close() must delete
        self._scratch: Path | None = None  # the head-side folder of node B's /etc/hosts
        self._procs: list[subprocess.Popen[Any]] = []

    # -- set-up and clean-up ----------------------------------------------------------------
    def start(self) -> TwoNodes:
        """Set node B up; NodeSetupError (after undoing what was made) if the host can not."""
        if self.anchor is not None or self._created:
            raise RuntimeError(f"{self.namespace} was started already: a TwoNodes starts once")
        try:
            self._set_up()
        except BaseException:
            self.close()
            raise
        return self

    def __enter__(self) -> TwoNodes:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _set_up(self) -> None:
        _check_host()
        if self.bridge is not None:
            self.head_address, self.node_address, prefix = self.bridge.address, self.bridge.next_address(), 24
        else:
            x = self._pick_subnet()
            self.head_address, self.node_address, prefix = f"{SUBNET}.{x}.1", f"{SUBNET}.{x}.2", 30
        _must(["ip", "netns", "add", self.namespace])
        self._created.append("netns")
        _must(["ip", "link", "add", self._veth, "type", "veth", "peer", "name", self.node_interface])
        self._created.append("link")
        _must(["ip", "link", "set", self.node_interface, "netns", self.namespace])
        if self.bridge is not None:
            _must(["ip", "link", "set", self._veth, "master", self.bridge.interface])
        else:
            _must(["ip", "addr", "add", f"{self.head_address}/{prefix}", "dev", self._veth])
        _must(["ip", "link", "set", self._veth, "up"])
        _must(["ip", "-n", self.namespace, "addr", "add", f"{self.node_address}/{prefix}", "dev", self.node_interface])
        _must(["ip", "-n", self.namespace, "link", "set", self.node_interface, "up"])
        _must(["ip", "-n", self.namespace, "link", "set", "lo", "up"])
        self._start_anchor()

    def _pick_subnet(self) -> int:
        used = _subnet_in_use()
        start = (os.getpid() * 7 + self._instance) % 256  # spread concurrent test processes
        for step in range(256):
            x = (start + step) % 256
            if x not in used:
                return x
        raise NodeSetupError(f"every {SUBNET}.X.0/30 is in use")

    def _start_anchor(self) -> None:
        self._scratch = Path(tempfile.mkdtemp(prefix=f"{self.namespace}-"))
        hosts = self._scratch / "hosts"
        hosts.write_text(f"127.0.0.1 localhost\n{self.node_address} {self.hostname}\n")
        self.anchor = subprocess.Popen(
            [
                *("ip", "netns", "exec", self.namespace),
                *("unshare", "--mount", "--uts", "--propagation", "private"),
                *("sh", "-c", _ANCHOR_SCRIPT, "anchor", str(hosts), str(self.node_private), self.hostname),
                *shared_under_private(),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env={"PATH": SYSTEM_PATH},
        )
        assert self.anchor.stdout is not None
        ready, _, _ = select.select([self.anchor.stdout], [], [], SETUP_TIMEOUT_S)
        line = self.anchor.stdout.readline() if ready else b""
        if line.strip() != b"ready":
            self._stop_anchor()
            assert self.anchor.stderr is not None
            why = self.anchor.stderr.read().decode(errors="replace").strip() or "no answer"
            raise NodeSetupError(f"node B's mount and UTS namespaces could not be made: {why}")

    def close(self) -> None:
        """Kill what `popen` started (and its descendants), stop the anchor, delete the veth
        pair and the namespace by name. Idempotent; raises if a deletion failed."""
        for proc in self._procs:
            _kill_tree(proc)
        self._procs.clear()
        self._stop_anchor()
        failures = []
        if "link" in self._created:  # deleting one end deletes the pair, wherever the other is
            done = _run(["ip", "link", "del", self._veth])
            if done.returncode != 0:
                failures.append(f"ip link del {self._veth}: {done.stderr.strip()}")
        if "netns" in self._created:
            done = _run(["ip", "netns", "del", self.namespace])
            if done.returncode != 0:
                failures.append(f"ip netns del {self.namespace}: {done.stderr.strip()}")
        self._created.clear()
        if self._scratch is not None:
            shutil.rmtree(self._scratch, ignore_errors=True)
            self._scratch = None
        if failures:
            raise RuntimeError(f"node B's clean-up failed: {'; '.join(failures)}")

    def _stop_anchor(self) -> None:
        if self.anchor is None or self.anchor.poll() is not None:
            return
        assert self.anchor.stdin is not None
        with contextlib.suppress(BrokenPipeError):
            self.anchor.stdin.close()  # its `read` ends
        try:
            self.anchor.wait(KILL_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.anchor.kill()
            self.anchor.wait(KILL_TIMEOUT_S)

    # -- running programs as node B ---------------------------------------------------------
    def wrap(self, argv: Sequence[str], cwd: str | os.PathLike[str] | None = None) -> list[str]:
        """The argv that runs `argv` as node B, in `cwd` (default: this process's, which must
        not be under /tmp or /dev/shm). Exec all the way: its pid is `argv`'s program."""
        assert self.anchor is not None and self.anchor.poll() is None, "node B is not up"
        where = os.fspath(cwd) if cwd is not None else os.getcwd()
        return ["nsenter", f"--target={self.anchor.pid}", "--net", "--mount", "--uts", f"--wd={where}", "--", *argv]

    def node_env(self, cache_dir: Path | None = None, **extra: str) -> dict[str, str]:
        """Node B's environment, from nothing: the venv first on PATH, HOME, offline, no usage
        stats, unbuffered, its host interface settings (GLOO_SOCKET_IFNAME, VLLM_HOST_IP),
        NODE_PASSTHROUGH's engine settings if the head has them, ENGINECTL_CACHE_DIR=`cache_dir`
        (a shared folder: `shared_model`), then `extra`."""
        env = {
            "PATH": f"{BIN}:{SYSTEM_PATH}",
            "HOME": os.environ.get("HOME", "/root"),
            "VIRTUAL_ENV": str(BIN.parent),
            "LANG": "C.UTF-8",
            "HF_HUB_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "PYTHONUNBUFFERED": "1",
            "GLOO_SOCKET_IFNAME": self.node_interface,
            "VLLM_HOST_IP": self.node_address,
        }
        env.update({name: os.environ[name] for name in NODE_PASSTHROUGH if name in os.environ})
        if cache_dir is not None:
            env["ENGINECTL_CACHE_DIR"] = str(cache_dir)
        env.update(extra)
        return env

    def head_env(self, env: Mapping[str, str]) -> dict[str, str]:
        """`env` with the head's host interface settings: gloo on `head_interface`, vLLM
        announcing `head_address`."""
        return {**env, "GLOO_SOCKET_IFNAME": self.head_interface, "VLLM_HOST_IP": self.head_address}

    def popen(
        self,
        argv: Sequence[str],
        env: Mapping[str, str] | None = None,
        cwd: str | os.PathLike[str] | None = None,
        **kwargs: Any,
    ) -> subprocess.Popen[Any]:
        """Start `argv` as node B (`env` default: `node_env()`; kwargs go to Popen); killed
        with its descendants at `close` if still running."""
        proc: subprocess.Popen[Any] = subprocess.Popen(
            self.wrap(argv, cwd), env=dict(env if env is not None else self.node_env()), **kwargs
        )
        self._procs.append(proc)
        return proc

    def track(self, proc: subprocess.Popen[Any]) -> None:
        """Have `close` kill a node-B process started elsewhere (e.g. a ServeProcess whose
        command is `wrap`'s)."""
        self._procs.append(proc)

    def python(self, code: str, *args: str, env: Mapping[str, str] | None = None) -> subprocess.Popen[str]:
        """`python -c code args...` (the venv's) as node B, text pipes on stdin, stdout and
        stderr: for a snippet the test talks to."""
        return self.popen(
            [sys.executable, "-c", code, *args],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    def run_python(
        self, code: str, *args: str, env: Mapping[str, str] | None = None, timeout: float = PYTHON_TIMEOUT_S
    ) -> subprocess.CompletedProcess[str]:
        """Run `python -c code args...` as node B to its end (killed after `timeout`: AssertionError); its stdout and stderr as text."""
        proc = self.python(code, *args, env=env)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_tree(proc)
            out, err = proc.communicate()
            raise AssertionError(f"node B's snippet did not end within {timeout}s:\n{out}\n{err}") from None
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _kill_tree(proc: subprocess.Popen[Any]) -> None:
    """SIGKILL `proc`'s descendants and `proc`, and reap it (no-op once it exited)."""
    if proc.poll() is not None:
        return
    with contextlib.suppress(psutil.NoSuchProcess):
        for child in psutil.Process(proc.pid).children(recursive=True):
            with contextlib.suppress(psutil.NoSuchProcess):
                child.send_signal(signal.SIGKILL)
    proc.kill()
    proc.wait(KILL_TIMEOUT_S)


def shared_model(shared: Path) -> Path:
    """The tiny test model where both nodes read it: built once under `shared`/enginectl-cache
    (pass that folder as ENGINECTL_CACHE_DIR to both nodes: `node_env(cache_dir=...)`)."""
    from enginectl.server.default_model import ensure_default_model

    return ensure_default_model(shared / "enginectl-cache")
