"""Generate the Python code for protos/enginectl/** (the one codegen entry point).

Writes `*_pb2.py`, `*_pb2.pyi` (mypy-protobuf), `*_pb2_grpc.py` and `*_pb2_grpc.pyi` next to
each .proto, so `enginectl.weights.v1.weight_version_pb2` resolves through the package
mapping in pyproject.toml. The output is checked in; `--check` regenerates into a temporary
tree and fails on any difference (CI runs it).
"""

from __future__ import annotations

import argparse
import filecmp
import shutil
import sys
import tempfile
from importlib import metadata
from pathlib import Path

# Pinned so that the checked-in output is reproducible; bump together with pyproject's dev extra.
PINNED = {"grpcio-tools": "1.85.1", "mypy-protobuf": "5.1.0"}

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "protos"
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py", "_pb2_grpc.pyi")


def _check_pins() -> None:
    for dist, want in PINNED.items():
        have = metadata.version(dist)
        if have != want:
            sys.exit(f"gen_protos: {dist}=={have} installed, {want} pinned (pip install {dist}=={want})")


def _proto_files() -> list[str]:
    return sorted(str(p.relative_to(PROTO_ROOT)) for p in (PROTO_ROOT / "enginectl").rglob("*.proto"))


def generate(out: Path) -> None:
    """Run protoc (from grpcio-tools) over every enginectl proto into `out`."""
    import grpc_tools
    from grpc_tools import protoc

    bin_dir = Path(sys.executable).parent
    wkt = Path(grpc_tools.__file__).parent / "_proto"
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"-I{wkt}",
        f"--plugin=protoc-gen-mypy={bin_dir / 'protoc-gen-mypy'}",
        f"--plugin=protoc-gen-mypy_grpc={bin_dir / 'protoc-gen-mypy_grpc'}",
        f"--python_out={out}",
        f"--grpc_python_out={out}",
        f"--mypy_out={out}",
        f"--mypy_grpc_out={out}",
        *_proto_files(),
    ]
    if protoc.main(args) != 0:
        sys.exit("gen_protos: protoc failed")


def _generated(tree: Path) -> set[str]:
    return {str(p.relative_to(tree)) for p in (tree / "enginectl").rglob("*") if p.name.endswith(GENERATED_SUFFIXES)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if checked-in code is stale")
    args = parser.parse_args()
    _check_pins()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        generate(out)
        fresh, current = _generated(out), _generated(PROTO_ROOT)
        if args.check:
            stale = sorted(
                (fresh ^ current)
                | {f for f in fresh & current if not filecmp.cmp(out / f, PROTO_ROOT / f, shallow=False)}
            )
            if stale:
                print("generated code is stale; run scripts/gen_protos.py:", *stale, sep="\n  ")
                return 1
            print(f"generated code is up to date ({len(fresh)} files)")
            return 0
        for f in current - fresh:
            (PROTO_ROOT / f).unlink()
        for f in sorted(fresh):
            shutil.copyfile(out / f, PROTO_ROOT / f)
        print(f"wrote {len(fresh)} files under {PROTO_ROOT / 'enginectl'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
