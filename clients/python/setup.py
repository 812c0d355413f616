"""Build hook: generates the gRPC stubs from the compactd repository's ``proto/``.

The generated modules land in ``compactd_client/_pb/`` of the build (never in the source
tree), with their imports rewritten from ``compactd.v1`` to ``compactd_client._pb.compactd.v1``
so the package owns no top-level ``compactd`` name. Where the protos are looked for, first
match wins:

1. ``$COMPACTD_PROTO_DIR`` (a directory holding ``compactd/v1/*.proto``);
2. ``proto/`` next to this file (an sdist made by this setup.py copies them there);
3. ``../../proto`` (this package inside a checkout of the compactd repository).
"""

from __future__ import annotations

import os
import re
import shutil
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py as _build_py
from setuptools.command.sdist import sdist as _sdist

HERE = Path(__file__).resolve().parent
PROTO_FILES = ("compactd/v1/session.proto", "compactd/v1/sessions.proto")
GENERATED_PACKAGE = "compactd_client._pb"


def proto_candidates() -> list[Path]:
    """Directories that may hold ``compactd/v1/*.proto``, in the order they are tried."""
    found = []
    env = os.environ.get("COMPACTD_PROTO_DIR")
    if env:
        found.append(Path(env).expanduser().resolve())
    found.append(HERE / "proto")
    found.append((HERE / ".." / ".." / "proto").resolve())
    return found


def find_proto_dir() -> Path:
    """The first candidate holding every proto file, or a SystemExit naming them all."""
    tried = proto_candidates()
    for cand in tried:
        if all((cand / f).is_file() for f in PROTO_FILES):
            return cand
    listing = "\n".join(f"  - {c}" for c in tried)
    raise SystemExit(
        "compactd-client: cannot find the compactd .proto files "
        f"({', '.join(PROTO_FILES)}). Looked in:\n{listing}\n"
        "Install from a checkout of the compactd repository (pip install ./clients/python "
        "from its root), or set COMPACTD_PROTO_DIR to the repository's proto/ directory."
    )


def generate(out: Path) -> list[Path]:
    """Runs grpcio-tools' protoc into ``out`` and fixes the generated imports."""
    from grpc_tools import protoc  # build requirement (pyproject.toml)
    import grpc_tools

    proto_dir = find_proto_dir()
    out.mkdir(parents=True, exist_ok=True)
    well_known = Path(grpc_tools.__file__).parent / "_proto"
    args = [
        "grpc_tools.protoc",
        f"-I{proto_dir}",
        f"-I{well_known}",
        f"--python_out={out}",
        f"--pyi_out={out}",
        f"--grpc_python_out={out}",
        *(str(proto_dir / f) for f in PROTO_FILES),
    ]
    if protoc.main(args) != 0:
        raise SystemExit(f"compactd-client: protoc failed on {proto_dir}")
    written = []
    for pkg in (out, out / "compactd", out / "compactd" / "v1"):
        init = pkg / "__init__.py"
        init.write_text('"""Generated from compactd\'s proto/ by setup.py; do not edit."""\n')
        written.append(init)
    for path in sorted((out / "compactd" / "v1").iterdir()):
        if path.suffix in (".py", ".pyi") and path.name != "__init__.py":
            text = path.read_text()
            text = re.sub(
                r"^from compactd\.v1 import",
                f"from {GENERATED_PACKAGE}.compactd.v1 import",
                text,
                flags=re.M,
            )
            path.write_text(text)
            written.append(path)
    print(f"compactd-client: generated stubs from {proto_dir}", file=sys.stderr)
    return written


class build_py(_build_py):
    """Builds the package, then generates the stubs into the build directory."""

    def run(self) -> None:
        super().run()
        out = Path(self.build_lib) / "compactd_client" / "_pb"
        self._generated = [str(p) for p in generate(out)]

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        return super().get_outputs(include_bytecode) + getattr(self, "_generated", [])


class sdist(_sdist):
    """An sdist carries a copy of the protos, so it builds away from the repository."""

    def make_release_tree(self, base_dir: str, files) -> None:
        super().make_release_tree(base_dir, files)
        src = find_proto_dir()
        for f in PROTO_FILES:
            dest = Path(base_dir) / "proto" / f
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src / f, dest)


setup(cmdclass={"build_py": build_py, "sdist": sdist})
