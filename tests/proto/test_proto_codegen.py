"""The generated gRPC modules are exactly what the build makes from protos/."""

from __future__ import annotations

import importlib.util
import pathlib
import shutil

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PROTOS = ROOT / "protos"
PACKAGE_OUT = ROOT / "specdec" / "proto"


def load_codegen():
    """By path, as setup.py does (the package needs torch; a build environment has none)."""
    spec = importlib.util.spec_from_file_location("_codegen_under_test", PACKAGE_OUT / "_codegen.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_generated_code_is_current(tmp_path):
    codegen = load_codegen()
    import specdec.proto  # noqa: F401  (the install generated them)

    fresh = codegen.render(PROTOS)
    stale = []
    for rel, content in fresh.items():
        have = PACKAGE_OUT / rel
        if not have.is_file() or have.read_bytes() != content:
            stale.append(rel)
    assert not stale, (f"generated modules differ from protos/ (pip install -e . again, or python "
                       f"specdec/proto/_codegen.py): {stale}")
    assert codegen.is_current(PROTOS, PACKAGE_OUT)


def test_imports_between_generated_modules_are_relative():
    text = (PACKAGE_OUT / "specdec" / "v1" / "specdec_pb2_grpc.py").read_text()
    assert "from . import specdec_pb2 as" in text
    assert "from specdec.v1 import" not in text


def test_a_changed_proto_is_detected_and_regenerated(tmp_path):
    codegen = load_codegen()
    protos = tmp_path / "protos"
    shutil.copytree(PROTOS, protos)
    out = tmp_path / "out"
    assert codegen.ensure(protos, out)  # missing -> generated
    assert codegen.is_current(protos, out) and not codegen.ensure(protos, out)
    proto = protos / "specdec" / "v1" / "specdec.proto"
    proto.write_text(proto.read_text().replace("message EndSessionResponse {",
                                               "message EndSessionResponse {\n  uint32 extra = 9;"))
    assert not codegen.is_current(protos, out)
    assert codegen.ensure(protos, out)
    assert "extra" in (out / "specdec" / "v1" / "specdec_pb2.pyi").read_text()


def test_generated_package_imports_and_registers_canonical_names():
    from specdec.proto import specdec_pb2 as pb
    from specdec.proto import specdec_pb2_grpc as pb_grpc

    assert pb.DESCRIPTOR.name == "specdec/v1/specdec.proto"
    assert pb.DESCRIPTOR.services_by_name["DraftService"].full_name == "specdec.v1.DraftService"
    assert pb_grpc.TargetServiceStub and pb_grpc.add_CoordinatorServicer_to_server


@pytest.mark.parametrize("path", ["setup.py", "MANIFEST.in"])
def test_build_files_exist(path):
    assert (ROOT / path).is_file()
