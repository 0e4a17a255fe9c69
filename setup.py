"""Build hook: generate the gRPC modules from protos/ into the package.

Everything else about the package is declared in pyproject.toml. The generated
modules are never committed; ``build_py`` writes them into the build tree (or,
for an editable install, next to the sources); importing the package never
generates them. The code is ``specdec/proto/_codegen.py``, loaded by path
because the ``specdec`` package itself needs torch, which an isolated build
environment does not have.
"""

import importlib.util
import pathlib

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = pathlib.Path(__file__).resolve().parent


def _codegen():
    spec = importlib.util.spec_from_file_location("_specdec_codegen", HERE / "specdec" / "proto" / "_codegen.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class BuildPyWithProtos(build_py):
    """build_py, then protoc on protos/**/*.proto into specdec/proto/."""

    def run(self):
        super().run()
        codegen = _codegen()
        if self.editable_mode:
            codegen.ensure(HERE / "protos", HERE / "specdec" / "proto")
        else:
            out = pathlib.Path(self.build_lib) / "specdec" / "proto"
            for path in codegen.generate(HERE / "protos", out):
                self.announce(f"generated {path}", level=2)


setup(cmdclass={"build_py": BuildPyWithProtos})
