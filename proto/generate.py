"""Generate the Python gRPC code in client/protocol/ from proto/kvstore/v1/kvstore.proto.

Run `python proto/generate.py` after editing the .proto; `--check` (used by CI) fails when the
committed code differs from a fresh generation.
"""

from __future__ import annotations

import pathlib
import sys
import tempfile

from grpc_tools import protoc

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROTO = "kvstore/v1/kvstore.proto"
OUT = ROOT / "client" / "protocol"
# grpcio-tools writes absolute imports from the proto path; the code lives in kvstore_client.protocol.
IMPORT_FIX = ("from kvstore.v1 import kvstore_pb2", "from kvstore_client.protocol import kvstore_pb2")


def generate(out_dir: pathlib.Path) -> dict[str, str]:
    with tempfile.TemporaryDirectory() as tmp:
        args = ["protoc", f"-I{ROOT / 'proto'}", f"--python_out={tmp}", f"--pyi_out={tmp}",
                f"--grpc_python_out={tmp}", str(ROOT / "proto" / PROTO)]
        if protoc.main(args) != 0:
            raise SystemExit("protoc failed")
        files = {}
        for path in sorted((pathlib.Path(tmp) / "kvstore" / "v1").glob("kvstore_pb2*")):
            files[path.name] = path.read_text().replace(*IMPORT_FIX)
    return files


def main() -> int:
    files = generate(OUT)
    if "--check" in sys.argv:
        stale = [n for n, text in files.items() if not (OUT / n).exists() or (OUT / n).read_text() != text]
        if stale:
            print(f"generated code is stale: {stale}; run python proto/generate.py", file=sys.stderr)
            return 1
        print("generated code is up to date")
        return 0
    OUT.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (OUT / name).write_text(text)
    print(f"wrote {', '.join(files)} to {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
