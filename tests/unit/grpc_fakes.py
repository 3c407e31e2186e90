"""Test doubles shared by the gRPC unit tests."""


class FakeServicerContext:
    """What RayServegRPCContext reads from grpc's servicer context at construction."""

    def __init__(self, metadata=(("application", "llm-lanes"),)):
        self._metadata = list(metadata)

    def auth_context(self):
        return {}

    def code(self):
        return None

    def details(self):
        return None

    def invocation_metadata(self):
        return self._metadata

    def peer(self):
        return "ipv4:127.0.0.1:5000"

    def peer_identities(self):
        return None

    def peer_identity_key(self):
        return None

    def trailing_metadata(self):
        return [("request_id", "req-1")]
