"""The gRPC protocol of embcache-server: stubs generated from ``proto/`` (``v1``), the tensor codec,
the hand-written encoding of the hot messages (``wire``) and the error table (``errors``).

Regenerate the stubs with ``python -m embcache.rpc.regen``.
"""
