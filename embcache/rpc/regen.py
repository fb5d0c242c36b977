"""Regenerate the gRPC stubs in ``embcache/rpc/v1/`` from ``proto/embcache/rpc/v1/*.proto``.

    python -m embcache.rpc.regen           # rewrite the committed stubs
    python -m embcache.rpc.regen --check   # exit 1 when they are stale (CI)

Needs ``grpcio-tools`` (the ``test`` extra pins the version the committed stubs were made with,
so ``--check`` compares like with like). The ``.proto`` path mirrors the package path, so the
generated imports (``from embcache.rpc.v1 import embcache_pb2``) work as they are.
"""

from __future__ import annotations

import argparse
import filecmp
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

__all__ = ["generate", "main"]

_ROOT = Path(__file__).resolve().parents[2]
_PROTO_ROOT = _ROOT / "proto"
_PACKAGE = Path("embcache/rpc/v1")
_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")
_GRPC_HEADER = "# mypy: ignore-errors\n"


def generate(out_dir: Path) -> list[Path]:
    """Run protoc on every ``.proto`` under ``proto/embcache/rpc/v1``; returns the files written under ``out_dir``.

    Raises:
        RuntimeError: grpcio-tools is missing or protoc failed.
    """
    try:
        from grpc_tools import protoc
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise RuntimeError("grpcio-tools is not installed: pip install -e '.[test]'") from exc
    include = str(Path(protoc.__file__).parent / "_proto")  # google/protobuf/*.proto shipped with grpc_tools
    protos = sorted(str(p.relative_to(_PROTO_ROOT)) for p in (_PROTO_ROOT / _PACKAGE).glob("*.proto"))
    if not protos:
        raise RuntimeError(f"no .proto files under {_PROTO_ROOT / _PACKAGE}")
    args = ["grpc_tools.protoc", f"-I{_PROTO_ROOT}", f"-I{include}", f"--python_out={out_dir}",
            f"--pyi_out={out_dir}", f"--grpc_python_out={out_dir}", *protos]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}")
    made = sorted(p for p in (out_dir / _PACKAGE).iterdir() if p.name.endswith(_SUFFIXES))
    for p in made:
        if p.name.endswith("_grpc.py"):  # untyped generated code: mypy follows the import but must not judge it
            p.write_text(_GRPC_HEADER + p.read_text())
    return made


def main(argv: Sequence[str] | None = None) -> int:
    """Regenerate the stubs in place, or with ``--check`` report whether they are current (exit 1 if not)."""
    parser = argparse.ArgumentParser(prog="python -m embcache.rpc.regen", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="compare with the committed stubs; change nothing")
    args = parser.parse_args(argv)
    target = _ROOT / _PACKAGE
    with tempfile.TemporaryDirectory() as tmp:
        made = generate(Path(tmp))
        stale = [p.name for p in made if not (target / p.name).exists() or not filecmp.cmp(p, target / p.name,
                                                                                           shallow=False)]
        extra = sorted(p.name for p in target.iterdir()
                       if p.name.endswith(_SUFFIXES) and p.name not in {m.name for m in made})
        if args.check:
            if stale or extra:
                print(f"stale gRPC stubs in {target}: {stale + extra}; run: python -m embcache.rpc.regen",
                      file=sys.stderr)
                return 1
            print(f"gRPC stubs in {target} are current")
            return 0
        for p in made:
            (target / p.name).write_bytes(p.read_bytes())
        for name in extra:
            (target / name).unlink()
        print(f"wrote {[p.name for p in made]} to {target}" + (f"; removed {extra}" if extra else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
