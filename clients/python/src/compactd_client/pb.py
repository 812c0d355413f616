"""The generated protobuf messages of ``compactd.v1`` in one namespace.

``pb.Part``, ``pb.MessageInfo``, ``pb.ClientUpdate``, ``pb.ContextFormat`` ... are the
classes protoc generated from the repository's ``proto/compactd/v1/*.proto`` at build time;
their fields are documented there. ``pb.SessionsStub`` is the raw gRPC stub.
"""

from compactd_client._pb.compactd.v1.session_pb2 import *  # noqa: F401,F403
from compactd_client._pb.compactd.v1.sessions_pb2 import *  # noqa: F401,F403
from compactd_client._pb.compactd.v1.sessions_pb2_grpc import SessionsStub  # noqa: F401
from compactd_client._pb.compactd.v1 import session_pb2, sessions_pb2  # noqa: F401
