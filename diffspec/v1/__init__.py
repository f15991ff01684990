"""Generated gRPC stubs for ``proto/diffspec/v1`` (``python -m diffspec.protogen``; do not edit)."""
