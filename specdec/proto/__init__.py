"""The generated gRPC modules of the wire contract (``protos/specdec/v1``).

    from specdec.proto import specdec_pb2 as pb, specdec_pb2_grpc as pb_grpc

The modules themselves live in ``specdec/proto/specdec/v1/`` and are never
edited or committed: the build (``setup.py``) generates them into the wheel, and
in a source checkout this package regenerates them on first import whenever they
are missing or older than the .proto files (see ``_codegen.py``), so the tests
run straight from a fresh clone.
"""

from __future__ import annotations

import pathlib
import warnings

from specdec.proto import _codegen

_HERE = pathlib.Path(__file__).resolve().parent
# In a source checkout the contract sits next to the package; an installed
# package has no protos/ beside it and uses the modules the build generated.
PROTO_ROOT = _HERE.parents[1] / "protos"


def _ensure_generated() -> None:
    if not (PROTO_ROOT / "specdec" / "v1").is_dir():
        return
    try:
        _codegen.ensure(PROTO_ROOT, _HERE)
    except ImportError:  # grpcio-tools missing: use what is there, if anything
        if not _codegen.generated_dir(_HERE).joinpath("specdec_pb2.py").is_file():
            raise ImportError(
                "specdec's gRPC modules are not generated and grpcio-tools is not installed: "
                "pip install grpcio-tools (or pip install -e .)"
            ) from None
        warnings.warn("grpcio-tools is not installed: cannot check the generated gRPC modules are current",
                      stacklevel=2)
    except OSError as e:  # e.g. a read-only checkout
        if not _codegen.is_current(PROTO_ROOT, _HERE) and not _codegen.generated_dir(_HERE).is_dir():
            raise
        warnings.warn(f"could not regenerate specdec's gRPC modules: {e}", stacklevel=2)


_ensure_generated()

from specdec.proto.specdec.v1 import specdec_pb2, specdec_pb2_grpc  # noqa: E402

__all__ = ["specdec_pb2", "specdec_pb2_grpc", "PROTO_ROOT"]
