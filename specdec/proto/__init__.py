"""The generated gRPC modules of the wire contract (``protos/specdec/v1``).

    from specdec.proto import specdec_pb2 as pb, specdec_pb2_grpc as pb_grpc

The modules themselves live in ``specdec/proto/specdec/v1/`` and are never
edited or committed: the build (``setup.py``) generates them, into the wheel or,
for an editable install (``pip install -e .``), next to the sources. Importing
never generates them; ``tests/proto/test_proto_codegen.py`` fails when they are
older than the .proto files (install again, or run ``python specdec/proto/_codegen.py``).
"""

from __future__ import annotations

import pathlib

from specdec.proto import _codegen

_HERE = pathlib.Path(__file__).resolve().parent
# In a source checkout the contract sits next to the package; an installed
# package has no protos/ beside it.
PROTO_ROOT = _HERE.parents[1] / "protos"

if not _codegen.generated_dir(_HERE).joinpath("specdec_pb2.py").is_file():
    raise ImportError("specdec's gRPC modules are not generated: install the package (pip install -e . in a "
                      "source checkout), which generates them from protos/")

from specdec.proto.specdec.v1 import specdec_pb2, specdec_pb2_grpc  # noqa: E402

__all__ = ["specdec_pb2", "specdec_pb2_grpc", "PROTO_ROOT"]
