"""Generated from ``proto/embcache/rpc/v1/embcache.proto`` by ``python -m embcache.rpc.regen``; do not edit."""
