"""Code generated from proto/kvstore/v1/kvstore.proto; do not edit."""
